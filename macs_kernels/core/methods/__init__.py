"""Attribution methods that change what a row is (efficient attention rows, norm-weighted rows), over
the tensors an engine hands them."""
