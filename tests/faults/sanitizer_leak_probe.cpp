// A leak that LibTorch's own code allocates, planted for the sanitizer build: tests/sanitizers.supp
// may hide LibTorch's intentional never-freed objects (its thread pool after a fork), but not
// everything LibTorch allocates on our behalf. An autograd node is made by LibTorch (the multiply
// records MulBackward0, allocated inside libtorch_cpu), and our code could leak it by keeping a
// reference cycle or, as here, by dropping a tensor without its destructor. ctest expects
// LeakSanitizer to report an object allocated from a libtorch_cpu frame; with a suppression as
// wide as `leak:libtorch_cpu.so` (the one this replaced) it would not.
#include <torch/torch.h>

#include <cstdio>
#include <string>

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode != "autograd-node") {
    std::fprintf(stderr, "usage: sanitizer_leak_probe autograd-node\n");
    return 2;
  }
  at::Tensor x = torch::ones({4}, torch::requires_grad());
  at::Tensor y = x * 2;  // y's grad_fn: a MulBackward0 node that LibTorch allocates
  if (!y.grad_fn()) return 3;
  // The tensor's reference is released and never given back: the TensorImpl, its autograd meta
  // and the node stay allocated with nothing pointing at them.
  y.unsafeReleaseTensorImpl();
  return 0;
}
