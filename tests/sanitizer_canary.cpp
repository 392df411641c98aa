// Planted bugs for the sanitizer build (FSDP_SANITIZE): ctest expects each sanitizer's report
// from its mode, so a build whose sanitizers stopped working (flags lost, a runtime that does not
// load, LeakSanitizer off) fails instead of passing everything silently. The last two leak what
// only LibTorch's own code allocates, an autograd node and a c10d Work, and run under
// tests/sanitizers.supp as every suite does: a suppression wide enough to hide our leaks of
// LibTorch's objects (it once hid all of libtorch_cpu.so) fails them.
#include <torch/torch.h>

#include <chrono>
#include <climits>
#include <cstdio>
#include <cstring>
#include <string>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "fsdp/compat_backends.h"

namespace {
volatile int sink;
int* volatile holder;  // volatile: the compiler may not drop the allocation it holds
volatile int index_past_end = 8;
}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "leak") {
    holder = new int[64];
    holder = nullptr;  // the only pointer to it is gone
    return 0;
  }
  if (mode == "overflow") {
    char* p = new char[8];
    std::memset(p, 0, 8);
    sink = p[index_past_end];  // one past the end
    delete[] p;
    return 0;
  }
  if (mode == "ub") {
    int big = INT_MAX - (argc > 99 ? 1 : 0);
    sink = big + 1;  // signed overflow
    return 0;
  }
  if (mode == "leak_autograd") {
    // y's TensorImpl, its autograd metadata and its grad_fn (MulBackward0) are all allocated
    // inside LibTorch; releasing the only reference leaks them with no frame of ours on their
    // allocation stacks.
    at::Tensor x = torch::ones({4}, torch::requires_grad());
    at::Tensor y = x * 2;
    (void)y.unsafeReleaseTensorImpl();
    return 0;
  }
  if (mode == "leak_work") {
    // A one-rank Gloo group's all_reduce: the Work object c10d allocates, never released.
    auto store = c10::make_intrusive<c10d::HashStore>();
    auto backend =
        fsdp::compat::make_gloo_backend(store, 0, 1, std::chrono::seconds(10), "127.0.0.1", 1);
    std::vector<at::Tensor> tensors{torch::ones({4})};
    auto work = backend->allreduce(tensors);
    work->wait();
    (void)work.release();
    return 0;
  }
  std::fprintf(stderr, "usage: sanitizer_canary leak|overflow|ub|leak_autograd|leak_work\n");
  return 2;
}
