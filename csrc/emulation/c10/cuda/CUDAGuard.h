// See CUDAStream.h.
#pragma once

#include "c10/cuda/CUDAStream.h"
