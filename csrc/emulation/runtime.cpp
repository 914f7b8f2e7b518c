// The emulation's runtime (cpu.h): fibers, barriers, copies, launches, and the CUDA runtime calls that the launchers
// make, answered as an H200 would.
#include <cxxabi.h>
#include <dlfcn.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <mutex>
#include <numeric>
#include <random>
#include <string>

namespace cuda_emulation {
namespace {

// Each fiber's stack: the kernels keep their fragments and accumulators there, and printf needs a few KiB.
constexpr size_t kStackBytes = 256 * 1024;

// A switch between fibers saves the callee-saved registers on the running stack and loads another stack: no system
// call (swapcontext saves the signal mask with one: the emulation ran 8x slower). Other architectures use ucontext.
#if defined(__x86_64__)
struct Context {
  void* stack_pointer = nullptr;
};
extern "C" void cuda_emulation_switch(void** save, void* load);
asm(R"(
  .text
  .globl cuda_emulation_switch
  .type cuda_emulation_switch, @function
cuda_emulation_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size cuda_emulation_switch, .-cuda_emulation_switch
)");
void switch_context(Context& save, Context& load) { cuda_emulation_switch(&save.stack_pointer, load.stack_pointer); }
// A context that starts `entry` (which never returns) on `stack`: what cuda_emulation_switch pops, then entry as the
// return address, aligned as after a call.
void start_context(Context& context, char* stack, size_t bytes, void (*entry)()) {
  auto* top = reinterpret_cast<uint64_t*>((reinterpret_cast<uintptr_t>(stack) + bytes) & ~uintptr_t(15));
  top -= 2;
  top[0] = reinterpret_cast<uint64_t>(entry);
  top[1] = 0;
  top -= 7;  // the control words, then r15, r14, r13, r12, rbx, rbp
  uint32_t control[2];
  asm volatile("stmxcsr %0\n\tfnstcw %1" : "=m"(control[0]), "=m"(control[1]));
  std::memcpy(top, control, 8);
  for (int i = 1; i < 7; ++i) top[i] = 0;
  context.stack_pointer = top;
}
#else
}  // namespace
}  // namespace cuda_emulation
#include <ucontext.h>
namespace cuda_emulation {
namespace {
struct Context {
  ucontext_t context;
};
void switch_context(Context& save, Context& load) { swapcontext(&save.context, &load.context); }
void start_context(Context& context, char* stack, size_t bytes, void (*entry)()) {
  getcontext(&context.context);
  context.context.uc_stack.ss_sp = stack;
  context.context.uc_stack.ss_size = bytes;
  context.context.uc_link = nullptr;
  makecontext(&context.context, entry, 0);
}
#endif

struct Fiber {
  Context context;
  Thread state;
  bool done = false;
};

struct Scheduler {
  Context main;
  std::vector<Fiber> fibers;
  int running = -1;
  uint64_t progress = 0;  // arrivals, opened barriers and exits: none in a whole round is a deadlock
  void (*run_thread)(void*) = nullptr;
  void* call = nullptr;
};

Scheduler* scheduler = nullptr;
Thread* current = nullptr;
cudaError_t last_error = cudaSuccess;
bool launch_failed = false;  // the running launch failed: it stops after the block that failed
std::string last_error_text;

// The maximum dynamic shared memory each kernel was allowed (cudaFuncSetAttribute); 48 KiB without. Each grant is also
// logged (the latest kLaunchLog), for tests of how often the launchers ask.
std::map<const void*, int> max_dynamic_shared;
std::deque<std::pair<const void*, int>> shared_grants;
std::string shared_grants_text;
constexpr size_t kDefaultDynamicSharedBytes = 48 * 1024;

// The dynamic shared memory's pages, then a page mapped without access: a launch's region ends at it, so that an access
// past the size the launch asked for faults as on the GPU.
unsigned char* shared_pages = nullptr;
size_t shared_pages_bytes = 0;
unsigned char* shared_memory = nullptr;
std::vector<std::pair<void*, size_t>> static_shared;  // every kernel's __shared__ arrays met so far

void map_shared_memory() {
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  shared_pages_bytes = (kMaxDynamicSharedBytes + page - 1) / page * page;
  void* mapping = mmap(nullptr, shared_pages_bytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapping == MAP_FAILED || mprotect(static_cast<char*>(mapping) + shared_pages_bytes, page, PROT_NONE) != 0) {
    std::perror("cuda emulation: shared memory");
    std::abort();
  }
  shared_pages = static_cast<unsigned char*>(mapping);
}
std::vector<std::unique_ptr<char[]>> stacks;

// The launches (the latest kLaunchLog), for tests that check which kernel a launcher chose and its grid, as a
// profiler lists them on a GPU; named when read (demangling costs more than a launch of the launchers' host path).
constexpr size_t kLaunchLog = 4096;
std::deque<LaunchConfig> launches;
std::string launches_text;
// Whether launches run their kernels: off, a launch is checked and logged only, and an op costs what its host path
// costs (benchmarks/bench_checks.py).
bool execute = true;
// The launch whose blocks this thread runs now (null between launches): what a counted access is credited to.
__attribute__((tls_model("initial-exec"))) thread_local const void* running_kernel = nullptr;

// While counting (off by default; macs_kernels/apps/bench/traffic.py): the global-memory accesses of the kernels this
// host thread launches. Every 16-byte asynchronous copy that reads global memory, and every plain load and store (the
// emulation compiles csrc/ with -fsanitize=thread, whose callbacks come here) in a watched span: the caller's
// tensors, or a buffer the launchers name while counting, from name_buffer until forget_buffer (an access is credited
// to the latest living one that holds it). Atomic operations are not counted (the kernels make none). The callbacks
// run on every access, so they call nothing instrumented (they would call themselves back): plain arrays, grown by
// realloc.
struct Access {
  uint64_t address;
  const void* kernel;
  int32_t buffer;  // index into AccessLog::buffers, or -1
  uint16_t bytes;
  uint8_t written;
  uint8_t before_wait;  // made by a thread of the kernel before its wait_for_prior_grid (or outside any thread)
};
struct Span {
  uint64_t start, end;
  const char* name;     // a named buffer's (the launchers' string literals)
  uint64_t alive = 1;  // a named buffer's: 0 once freed
};
constexpr int kMaxWatched = 64;
// Most accesses of a running kernel are to its fibers' stacks, shared memory and the emulation's own warps: a hash set
// of the 4 KiB pages the spans touch turns those away with one probe (pages, not larger chunks: small tensors share
// the heap's pages with the emulation's structures).
constexpr int kPageShift = 12;
struct AccessLog {
  Span watched[kMaxWatched];
  int watched_count = 0;
  Span* buffers = nullptr;
  size_t buffer_count = 0, buffer_capacity = 0;
  Access* accesses = nullptr;
  size_t access_count = 0, access_capacity = 0;
  uint64_t* pages = nullptr;  // open addressing: page index + 1, 0 for an empty slot
  size_t page_slots = 0, page_count = 0;
};
__attribute__((tls_model("initial-exec"))) thread_local AccessLog* access_log = nullptr;

__attribute__((no_sanitize_thread)) size_t page_slot(const AccessLog* log, uint64_t page) {
  size_t slot = size_t(page * 0x9E3779B97F4A7C15ull) & (log->page_slots - 1);
  while (log->pages[slot] != 0 && log->pages[slot] != page + 1) slot = (slot + 1) & (log->page_slots - 1);
  return slot;
}

__attribute__((no_sanitize_thread)) void add_pages(AccessLog* log, uint64_t start, uint64_t end) {
  for (uint64_t page = start >> kPageShift; start < end && page <= (end - 1) >> kPageShift; ++page) {
    if (2 * (log->page_count + 1) > log->page_slots) {
      uint64_t* old = log->pages;
      const size_t old_slots = log->page_slots;
      log->page_slots = old_slots == 0 ? 1024 : 2 * old_slots;
      log->pages = static_cast<uint64_t*>(std::calloc(log->page_slots, sizeof(uint64_t)));
      if (log->pages == nullptr) std::abort();
      for (size_t i = 0; i < old_slots; ++i) {
        if (old[i] != 0) log->pages[page_slot(log, old[i] - 1)] = old[i];
      }
      std::free(old);
    }
    const size_t slot = page_slot(log, page);
    if (log->pages[slot] == 0) {
      log->pages[slot] = page + 1;
      ++log->page_count;
    }
  }
}

template <typename T>
__attribute__((no_sanitize_thread)) void append(T*& items, size_t& count, size_t& capacity, const T& item) {
  if (count == capacity) {
    capacity = capacity == 0 ? 4096 : 2 * capacity;
    items = static_cast<T*>(std::realloc(items, capacity * sizeof(T)));
    if (items == nullptr) std::abort();
  }
  items[count++] = item;
}

__attribute__((no_sanitize_thread, noinline)) void log_access(AccessLog* log, const void* address, size_t bytes,
                                                                 bool written, bool copy) {
  const uint64_t at = reinterpret_cast<uint64_t>(address);
  if (!copy && (log->page_slots == 0 || log->pages[page_slot(log, at >> kPageShift)] == 0)) return;
  int32_t buffer = -1;
  for (size_t i = log->buffer_count; i-- > 0;) {
    if (at >= log->buffers[i].start && at < log->buffers[i].end && log->buffers[i].alive) {
      buffer = int32_t(i);
      break;
    }
  }
  bool watched = copy || buffer >= 0;
  for (int i = 0; i < log->watched_count && !watched; ++i) {
    watched = at >= log->watched[i].start && at < log->watched[i].end;
  }
  if (!watched) return;
  Access access;
  access.address = at;
  access.kernel = running_kernel;
  access.buffer = buffer;
  access.bytes = uint16_t(bytes);
  access.written = uint8_t(written);
  access.before_wait = uint8_t(current == nullptr || !current->waited_for_prior_grid);
  append(log->accesses, log->access_count, log->access_capacity, access);
}

// Every plain access comes here: the common case (not counting) returns at once.
__attribute__((no_sanitize_thread, always_inline)) inline void note_access(const void* address, size_t bytes,
                                                                           bool written, bool copy) {
  AccessLog* log = access_log;
  if (__builtin_expect(log != nullptr && running_kernel != nullptr, 0)) log_access(log, address, bytes, written, copy);
}

std::string kernel_name(const void* kernel) {
  Dl_info info{};
  if (dladdr(kernel, &info) == 0 || info.dli_sname == nullptr) return "?";
  int status = 0;
  char* demangled = abi::__cxa_demangle(info.dli_sname, nullptr, nullptr, &status);
  std::string name = status == 0 && demangled != nullptr ? demangled : info.dli_sname;
  std::free(demangled);
  return name;
}

std::string dims(const dim3& d) {
  return std::to_string(d.x) + ',' + std::to_string(d.y) + ',' + std::to_string(d.z);
}

// The order in which a launch's blocks run, and a block's threads between two barriers (0: the first first, 1: the
// last first, 2: shuffled anew each time). A result that changes with it is a race: between threads, one that no
// barrier orders; between blocks, two of them writing one place (a GPU runs them in any order, and at once).
int order = 0;
std::mt19937 shuffle{0};

// The emulated GPU (cudaDeviceGetAttribute): an H200 unless set.
struct Device {
  int multiprocessors = 132, shared_per_block = int(kMaxDynamicSharedBytes), shared_per_multiprocessor = 228 * 1024,
      major = 9;
} device;

// Blocks run one at a time: the dynamic shared memory, a kernel's static __shared__ arrays and the fibers are the
// block's. Launches from several host threads take turns.
std::mutex launch_mutex;

void fail(cudaError_t error, std::string text) {
  last_error = error;
  last_error_text = std::move(text);
}

void switch_to_main() { switch_context(scheduler->fibers[scheduler->running].context, scheduler->main); }

// The calling fiber's thread has exited: it no longer counts at its barriers.
[[noreturn]] void exit_thread() {
  ++current->warp->exited;
  current->warp->sync.drop();
  current->block->sync.drop();
  scheduler->fibers[scheduler->running].done = true;
  ++scheduler->progress;
  switch_to_main();
  std::abort();  // a finished fiber is never resumed
}

[[noreturn]] void fiber_entry() {
  scheduler->run_thread(scheduler->call);
  exit_thread();
}

// Runs one block's threads to their ends; false when they deadlock (every live thread waits at a barrier that the
// others never reach).
bool run_block(Block& block, int threads) {
  Scheduler& s = *scheduler;
  for (int i = 0; i < threads; ++i) {
    Fiber& fiber = s.fibers[i];
    fiber.done = false;
    fiber.state = Thread{};
    fiber.state.block = &block;
    fiber.state.warp = block.warps[i / kWarpSize].get();
    fiber.state.lane = i % kWarpSize;
    fiber.state.thread_idx = uint3{unsigned(i % block.block_dim.x), unsigned(i / block.block_dim.x % block.block_dim.y),
                                   unsigned(i / (block.block_dim.x * block.block_dim.y))};
    start_context(fiber.context, stacks[i].get(), kStackBytes, fiber_entry);
  }
  std::vector<int> sequence(threads);
  std::iota(sequence.begin(), sequence.end(), 0);
  if (order == 1) std::reverse(sequence.begin(), sequence.end());
  for (int live = threads; live > 0;) {
    const uint64_t before = s.progress;
    if (order == 2) std::shuffle(sequence.begin(), sequence.end(), shuffle);
    for (const int i : sequence) {
      if (s.fibers[i].done) continue;
      s.running = i;
      current = &s.fibers[i].state;
      switch_context(s.main, s.fibers[i].context);
      if (s.fibers[i].done) --live;
    }
    if (live > 0 && s.progress == before) return false;
  }
  return true;
}

void finish_copies(CopyGroup& group) {
  for (const CopyGroup::Copy& copy : group.copies) std::memcpy(copy.shared, copy.bytes, 16);
  group.copies.clear();
}

}  // namespace

void Barrier::arrive_and_wait() {
  const uint64_t mine = phase;
  ++scheduler->progress;
  if (++arrived == expected) {
    arrived = 0;
    ++phase;
    return;
  }
  while (phase == mine) switch_to_main();
}

void Barrier::drop() {
  --expected;
  if (arrived > 0 && arrived == expected) {
    arrived = 0;
    ++phase;
  }
}

Block::Block(dim3 grid_dim, dim3 block_dim, dim3 block_idx, int threads)
    : grid_dim(grid_dim), block_dim(block_dim), block_idx(block_idx), sync(threads) {
  for (int first = 0; first < threads; first += kWarpSize) {
    warps.push_back(std::make_unique<Warp>(threads - first < kWarpSize ? threads - first : kWarpSize));
  }
}

Thread& thread() { return *current; }

unsigned char* dynamic_shared_memory() { return shared_memory; }

void static_shared_memory(void* array, size_t bytes) {
  for (const auto& known : static_shared) {
    if (known.first == array) return;
  }
  // The first thread to declare it, before any thread uses it: poisoned now, and at the start of every later block.
  static_shared.emplace_back(array, bytes);
  std::memset(array, 0xff, bytes);
}

void fail_launch(const char* why) {
  if (!launch_failed) fail(cudaErrorLaunchFailure, std::string("unspecified launch failure (") + why + ")");
  launch_failed = true;
}

void trap(const char* why) {
  fail_launch(why);
  exit_thread();
}

void check_launch_bounds(int max_threads) {
  const dim3 block = current->block->block_dim;
  if (int(block.x * block.y * block.z) > max_threads && !launch_failed) {
    launch_failed = true;
    fail(cudaErrorLaunchOutOfResources, "too many resources requested for launch (" +
                                            std::to_string(block.x * block.y * block.z) +
                                            " threads; the kernel's __launch_bounds__ allow " +
                                            std::to_string(max_threads) + ")");
  }
}

// Not instrumented: its read of `global` is counted once, as a copy.
__attribute__((no_sanitize_thread)) void copy16_async(void* shared, const void* global, bool fill) {
  check_aligned16(shared, "misaligned address: a cp.async destination not 16-byte aligned");
  if (fill) check_aligned16(global, "misaligned address: a cp.async source not 16-byte aligned");
  CopyGroup::Copy copy{shared, {}};
  if (fill) {
    std::memcpy(copy.bytes, global, 16);
    note_access(global, 16, false, true);
  }
  current->open.copies.push_back(copy);
  std::memset(shared, 0xff, 16);  // NaN until the group is waited for
}

void copy_async_commit() {
  current->committed.push_back(std::move(current->open));
  current->open = CopyGroup{};
}

void copy_async_wait(int pending) {
  while (int(current->committed.size()) > pending) {
    finish_copies(current->committed.front());
    current->committed.pop_front();
  }
}

bool launch_refused(const LaunchConfig& config) {
  const std::lock_guard<std::mutex> lock(launch_mutex);
  const int threads = int(config.block.x * config.block.y * config.block.z);
  const auto found = max_dynamic_shared.find(config.kernel);
  const size_t allowed = found == max_dynamic_shared.end() ? kDefaultDynamicSharedBytes : size_t(found->second);
  if (threads < 1 || threads > 1024 || config.block.z > 64 || config.grid.x < 1 || config.grid.y < 1 ||
      config.grid.z < 1 || config.grid.x > 2147483647u || config.grid.y > 65535 || config.grid.z > 65535) {
    fail(cudaErrorInvalidConfiguration, "invalid configuration argument");
    return true;
  }
  if (config.shared_bytes > allowed) {
    fail(cudaErrorInvalidValue, "invalid argument (" + std::to_string(config.shared_bytes) +
                                    " bytes of dynamic shared memory; the kernel allows " + std::to_string(allowed) + ")");
    return true;
  }
  return false;
}

void run_grid(const LaunchConfig& config, void (*run_thread)(void*), void* call) {
  const std::lock_guard<std::mutex> lock(launch_mutex);
  const int threads = int(config.block.x * config.block.y * config.block.z);
  while (int(stacks.size()) < threads) stacks.emplace_back(new char[kStackBytes]);
  if (shared_pages == nullptr) map_shared_memory();
  shared_memory = shared_pages + shared_pages_bytes - (config.shared_bytes + 15) / 16 * 16;
  launches.push_back(config);
  if (launches.size() > kLaunchLog) launches.pop_front();
  if (!execute) return;
  running_kernel = config.kernel;
  struct Ended {
    ~Ended() {
      running_kernel = nullptr;
      scheduler = nullptr;
    }
  } ended;
  Scheduler s;
  s.fibers.resize(threads);
  s.run_thread = run_thread;
  s.call = call;
  scheduler = &s;
  launch_failed = false;
  // Blocks by linear index (x fastest); a shuffled order draws a permutation of them (the only order that stores
  // one: a grid may hold billions of blocks).
  const uint64_t count = uint64_t(config.grid.x) * config.grid.y * config.grid.z;
  std::vector<uint64_t> permutation;
  if (order == 2) {
    permutation.resize(count);
    std::iota(permutation.begin(), permutation.end(), uint64_t(0));
    std::shuffle(permutation.begin(), permutation.end(), shuffle);
  }
  for (uint64_t i = 0; i < count; ++i) {
    const uint64_t linear = order == 0 ? i : (order == 1 ? count - 1 - i : permutation[i]);
    const dim3 index(unsigned(linear % config.grid.x), unsigned(linear / config.grid.x % config.grid.y),
                     unsigned(linear / config.grid.x / config.grid.y));
    std::memset(shared_memory, 0xff, config.shared_bytes);
    for (const auto& array : static_shared) std::memset(array.first, 0xff, array.second);
    Block block(config.grid, config.block, index, threads);
    const bool finished = run_block(block, threads);
    if (launch_failed) return;
    if (!finished) {
      fail(cudaErrorLaunchFailure, "unspecified launch failure (emulation: the threads of block (" +
                                       std::to_string(index.x) + ", " + std::to_string(index.y) + ", " +
                                       std::to_string(index.z) + ") wait at barriers that the others never reach)");
      return;
    }
  }
}

void forget_buffer(const void* data) {
  AccessLog* log = access_log;
  if (log == nullptr) return;
  const uint64_t start = reinterpret_cast<uint64_t>(data);
  for (size_t i = log->buffer_count; i-- > 0;) {
    if (log->buffers[i].start == start && log->buffers[i].alive) {
      log->buffers[i].alive = 0;  // its bytes may become another buffer's, or no buffer's
      return;
    }
  }
}

void name_buffer(const char* name, const void* data, size_t bytes) {
  AccessLog* log = access_log;
  if (log == nullptr || bytes == 0) return;
  const uint64_t start = reinterpret_cast<uint64_t>(data);
  append(log->buffers, log->buffer_count, log->buffer_capacity, Span{start, start + bytes, name, 1});
  add_pages(log, start, start + bytes);
}

}  // namespace cuda_emulation

// The launches since the last call, one per line: kernel name, grid, block, dynamic shared memory, tab-separated
// (macs_kernels/ops/cuda/emulation.py reads it).
extern "C" const char* cuda_emulation_take_launches() {
  const std::lock_guard<std::mutex> lock(cuda_emulation::launch_mutex);
  cuda_emulation::launches_text.clear();
  for (const cuda_emulation::LaunchConfig& launch : cuda_emulation::launches) {
    cuda_emulation::launches_text += cuda_emulation::kernel_name(launch.kernel) + '\t' +
                                     cuda_emulation::dims(launch.grid) + '\t' + cuda_emulation::dims(launch.block) +
                                     '\t' + std::to_string(launch.shared_bytes) + '\t' +
                                     (launch.dependent ? "1" : "0") + '\n';
  }
  cuda_emulation::launches.clear();
  return cuda_emulation::launches_text.c_str();
}

// The grants of dynamic shared memory (cudaFuncSetAttribute) since the last call, one per line: kernel name, bytes.
extern "C" const char* cuda_emulation_take_shared_grants() {
  const std::lock_guard<std::mutex> lock(cuda_emulation::launch_mutex);
  cuda_emulation::shared_grants_text.clear();
  for (const auto& [kernel, bytes] : cuda_emulation::shared_grants) {
    cuda_emulation::shared_grants_text += cuda_emulation::kernel_name(kernel) + '\t' + std::to_string(bytes) + '\n';
  }
  cuda_emulation::shared_grants.clear();
  return cuda_emulation::shared_grants_text.c_str();
}

// Runs the kernels of later launches (1) or only checks and logs the launches (0).
extern "C" void cuda_emulation_set_execute(int execute) {
  const std::lock_guard<std::mutex> lock(cuda_emulation::launch_mutex);
  cuda_emulation::execute = execute != 0;
}

// Counts the global-memory accesses of the kernels this thread launches from now on, plain ones within the `count`
// spans [start, end) of `spans` or in buffers the launchers name (count -1: stops counting); either way forgets those
// counted so far. More than 64 spans: stops counting and returns 0.
extern "C" int cuda_emulation_count_accesses(const uint64_t* spans, int count) {
  using cuda_emulation::access_log;
  if (cuda_emulation::AccessLog* old = access_log) {
    access_log = nullptr;
    std::free(old->buffers);
    std::free(old->accesses);
    std::free(old->pages);
    delete old;
  }
  if (count < 0) return 1;
  if (count > cuda_emulation::kMaxWatched) return 0;
  auto* log = new cuda_emulation::AccessLog;
  for (int i = 0; i < count; ++i) {
    log->watched[i] = {spans[2 * i], spans[2 * i + 1], nullptr, 1};
    add_pages(log, spans[2 * i], spans[2 * i + 1]);
  }
  log->watched_count = count;
  access_log = log;
  return 1;
}

// The accesses counted so far (valid until the next count call): their number; each one's address, kernel, named
// buffer (an index into `buffers`, or -1), bytes and direction; and the named buffers, each one's span and name.
extern "C" size_t cuda_emulation_accesses(const void** accesses, const void** buffers, size_t* buffer_count) {
  const cuda_emulation::AccessLog* log = cuda_emulation::access_log;
  if (log == nullptr) return 0;
  *accesses = log->accesses;
  *buffers = log->buffers;
  *buffer_count = log->buffer_count;
  return log->access_count;
}

extern "C" const char* cuda_emulation_kernel_name(const void* kernel) {
  static std::string name;
  name = cuda_emulation::kernel_name(kernel);
  return name.c_str();
}

// Runs a launch's blocks, and each block's threads, from now on in `run_order` (0 forward, 1 reverse, 2 shuffled
// from `seed`).
extern "C" void cuda_emulation_set_order(int run_order, unsigned seed) {
  const std::lock_guard<std::mutex> lock(cuda_emulation::launch_mutex);
  cuda_emulation::order = run_order;
  cuda_emulation::shuffle.seed(seed);
}

// Answers the launchers' device queries as a GPU with these figures would from now on.
extern "C" void cuda_emulation_set_device(int multiprocessors, int shared_per_block, int shared_per_multiprocessor,
                                          int major) {
  const std::lock_guard<std::mutex> lock(cuda_emulation::launch_mutex);
  cuda_emulation::device = {multiprocessors, shared_per_block, shared_per_multiprocessor, major};
}

// The CUDA runtime calls of the launchers (no libcudart is linked).
extern "C" {

cudaError_t cudaGetLastError(void) {
  const cudaError_t error = cuda_emulation::last_error;
  cuda_emulation::last_error = cudaSuccess;
  return error;
}

const char* cudaGetErrorString(cudaError_t error) {
  if (error == cudaSuccess) return "no error";
  return cuda_emulation::last_error_text.empty() ? "unknown error" : cuda_emulation::last_error_text.c_str();
}

cudaError_t cudaFuncSetAttribute(const void* kernel, enum cudaFuncAttribute attribute, int value) {
  if (attribute != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaSuccess;
  if (value < 0 || value > cuda_emulation::device.shared_per_block) {
    cuda_emulation::fail(cudaErrorInvalidValue, "invalid argument (a maximum of " + std::to_string(value) +
                                                    " bytes of dynamic shared memory)");
    return cudaErrorInvalidValue;
  }
  const std::lock_guard<std::mutex> lock(cuda_emulation::launch_mutex);
  cuda_emulation::max_dynamic_shared[kernel] = value;
  cuda_emulation::shared_grants.emplace_back(kernel, value);
  if (cuda_emulation::shared_grants.size() > cuda_emulation::kLaunchLog) cuda_emulation::shared_grants.pop_front();
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  *device = 0;  // one emulated GPU
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, enum cudaDeviceAttr attribute, int) {
  const cuda_emulation::Device& device = cuda_emulation::device;
  switch (attribute) {
    case cudaDevAttrMultiProcessorCount:
      *value = device.multiprocessors;
      return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
      *value = device.shared_per_block;
      return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor:
      *value = device.shared_per_multiprocessor;
      return cudaSuccess;
    case cudaDevAttrComputeCapabilityMajor:
      *value = device.major;
      return cudaSuccess;
    default:
      return cudaErrorInvalidValue;
  }
}

// The callbacks of -fsanitize=thread (GCC, without its runtime): every plain load and store of the instrumented code,
// with its address and size, comes here first; an atomic operation comes here instead of running, so these run it.
// Uninstrumented themselves (they would call themselves back).
#define CUDA_EMULATION_UNCOUNTED __attribute__((no_sanitize_thread, visibility("hidden")))
#define CUDA_EMULATION_ACCESS(bytes)                                                                             \
  CUDA_EMULATION_UNCOUNTED void __tsan_read##bytes(void* address) {                                            \
    cuda_emulation::note_access(address, bytes, false, false);                                                 \
  }                                                                                                            \
  CUDA_EMULATION_UNCOUNTED void __tsan_write##bytes(void* address) {                                           \
    cuda_emulation::note_access(address, bytes, true, false);                                                  \
  }
CUDA_EMULATION_ACCESS(1)
CUDA_EMULATION_ACCESS(2)
CUDA_EMULATION_ACCESS(4)
CUDA_EMULATION_ACCESS(8)
CUDA_EMULATION_ACCESS(16)
#undef CUDA_EMULATION_ACCESS
// A range (an aggregate's copy) in pieces of at most 16 bytes, as the vector accesses that would move it.
CUDA_EMULATION_UNCOUNTED void __tsan_read_range(void* address, unsigned long bytes) {
  for (unsigned long at = 0; at < bytes; at += 16) {
    cuda_emulation::note_access(static_cast<char*>(address) + at, bytes - at < 16 ? bytes - at : 16, false, false);
  }
}
CUDA_EMULATION_UNCOUNTED void __tsan_write_range(void* address, unsigned long bytes) {
  for (unsigned long at = 0; at < bytes; at += 16) {
    cuda_emulation::note_access(static_cast<char*>(address) + at, bytes - at < 16 ? bytes - at : 16, true, false);
  }
}
CUDA_EMULATION_UNCOUNTED void __tsan_init(void) {}
CUDA_EMULATION_UNCOUNTED void __tsan_vptr_update(void**, void*) {}
#define CUDA_EMULATION_ATOMICS(bits, type)                                                                       \
  CUDA_EMULATION_UNCOUNTED type __tsan_atomic##bits##_load(const volatile void* at, int) {                    \
    return __atomic_load_n(static_cast<const volatile type*>(at), __ATOMIC_SEQ_CST);                           \
  }                                                                                                            \
  CUDA_EMULATION_UNCOUNTED void __tsan_atomic##bits##_store(volatile void* at, type value, int) {              \
    __atomic_store_n(static_cast<volatile type*>(at), value, __ATOMIC_SEQ_CST);                                \
  }                                                                                                            \
  CUDA_EMULATION_UNCOUNTED type __tsan_atomic##bits##_fetch_add(volatile void* at, type value, int) {          \
    return __atomic_fetch_add(static_cast<volatile type*>(at), value, __ATOMIC_SEQ_CST);                       \
  }                                                                                                            \
  CUDA_EMULATION_UNCOUNTED type __tsan_atomic##bits##_fetch_sub(volatile void* at, type value, int) {          \
    return __atomic_fetch_sub(static_cast<volatile type*>(at), value, __ATOMIC_SEQ_CST);                       \
  }                                                                                                            \
  CUDA_EMULATION_UNCOUNTED bool __tsan_atomic##bits##_compare_exchange_weak(volatile void* at, void* expected, \
                                                                            type desired, int, int) {          \
    return __atomic_compare_exchange_n(static_cast<volatile type*>(at), static_cast<type*>(expected), desired, \
                                       true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                              \
  }
CUDA_EMULATION_ATOMICS(8, unsigned char)
CUDA_EMULATION_ATOMICS(32, unsigned int)
CUDA_EMULATION_ATOMICS(64, unsigned long)
#undef CUDA_EMULATION_ATOMICS
#undef CUDA_EMULATION_UNCOUNTED

}  // extern "C"
