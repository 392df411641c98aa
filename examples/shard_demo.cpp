// shard_demo: shards a small model across the ranks of a torchrun-style launch, shows what each
// rank holds, unshards it, trains one SGD step on the shards and checks the result against the
// same step taken by one process on the whole batch.
//
//   RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 ./shard_demo & (and RANK=1 ...)
// or simply scripts/demo.sh.
#include <cstdio>
#include <iostream>

#include <torch/torch.h>

#include "fsdp/fsdp.h"

namespace {

torch::nn::Sequential make_model() {
  torch::manual_seed(42);  // identical initial weights on every rank
  return torch::nn::Sequential(torch::nn::Linear(10, 33), torch::nn::ReLU(),
                               torch::nn::Linear(33, 7));
}

torch::Tensor batch_of(int rank) {
  torch::manual_seed(1000 + rank);
  return torch::randn({8, 10});
}

}  // namespace

int main() {
  try {
    auto pg =
        fsdp::dist::init_process_group(fsdp::dist::InitOptions().timeout(std::chrono::seconds(60)));
    const int rank = pg.rank();
    const int world = pg.size();
    auto model = make_model();
    std::vector<torch::Tensor> before;
    for (const auto& p : model->parameters()) before.push_back(p.detach().clone());

    fsdp::FlatParamHandle handle(fsdp::collect_params(model.ptr()), pg);
    const auto& layout = handle.layout();
    const auto md = handle.shard_metadata();
    std::ostringstream os;
    os << "[rank " << rank << "/" << world
       << "] flat parameter: " << layout.unpadded_unsharded_numel << " elements, shard of "
       << layout.sharded_numel << " (" << handle.shard_numel_padded() << " padding); holds";
    for (size_t i = 0; i < md.param_names.size(); ++i) {
      os << " " << md.param_names[i] << "[" << md.param_offsets[i].first << ".."
         << md.param_offsets[i].second << "]";
    }
    std::cout << os.str() << std::endl;

    // Unshard: every parameter is back, bit for bit; reshard frees the memory again.
    handle.unshard();
    bool same = true;
    auto params = model->parameters();
    for (size_t i = 0; i < params.size(); ++i) same &= torch::equal(params[i], before[i]);
    const int64_t bytes = handle.unsharded_storage_bytes();

    // One data-parallel step: each rank its own batch; gradients reduce-scattered into shards.
    auto loss = model->forward(batch_of(rank)).pow(2).mean();
    loss.backward();
    handle.reduce_grad();
    handle.reshard();
    std::cout << "[rank " << rank
              << "] unshard restored parameters bit-exactly: " << (same ? "yes" : "NO")
              << "; unsharded storage " << bytes << " B -> " << handle.unsharded_storage_bytes()
              << " B after reshard" << std::endl;
    torch::optim::SGD opt({handle.flat_param()}, torch::optim::SGDOptions(0.1));
    opt.step();

    // Reference: one process, the whole batch (mean of per-rank losses), same step.
    auto ref = make_model();
    torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
    for (int r = 0; r < world; ++r) (ref->forward(batch_of(r)).pow(2).mean() / world).backward();
    ref_opt.step();

    handle.unshard();
    double max_diff = 0;
    auto ref_params = ref->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      max_diff = std::max(max_diff, (params[i] - ref_params[i]).abs().max().item<double>());
    }
    handle.reshard();
    const bool ok = same && max_diff < 1e-6;
    std::cout << "[rank " << rank
              << "] after one sharded SGD step, max |sharded - single process| = " << max_diff
              << (ok ? "  OK" : "  MISMATCH") << std::endl;
    pg.barrier();
    fsdp::dist::destroy_process_group();
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "shard_demo: " << e.what() << std::endl;
    return 2;
  }
}
