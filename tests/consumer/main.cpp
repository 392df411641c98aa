// Wraps a model, trains a step, saves a checkpoint and loads it back: the README's example, built
// against an installed fsdp-cpp (find_package(fsdp)). Run it under fsdp-run.
#include <torch/torch.h>

#include <cstdio>

#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/checkpoint/state_dict.h"
#include "fsdp/fsdp.h"

struct NetImpl : torch::nn::Module {
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 1));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return fc2(torch::relu(fsdp::forward(fc1, x)));  // fc1 is a unit of its own
  }
};
TORCH_MODULE(Net);

int main(int argc, char** argv) {
  auto pg = fsdp::dist::init_process_group();  // RANK, WORLD_SIZE, ... from fsdp-run
  torch::manual_seed(0);
  Net net;
  fsdp::FullyShardedDataParallel model(net, fsdp::FullyShardedOptions().units({net->fc1.ptr()}));
  torch::optim::Adam opt(model->parameters(), 1e-2);
  auto x = torch::randn({4, 8}), y = torch::randn({4, 1});
  auto loss = torch::mse_loss(model->forward(x), y);
  loss.backward();
  opt.step();

  namespace ckpt = fsdp::checkpoint;
  auto [msd, osd] = ckpt::get_state_dict(model, opt);
  fsdp::StateDict sd;
  sd.insert_or_assign("model", msd);
  sd.insert_or_assign("optim", osd);
  const std::string dir = argc > 1 ? argv[1] : "consumer_ckpt";
  ckpt::save(sd, dir);
  ckpt::load(sd, dir);
  ckpt::set_state_dict(model, opt, sd.at("model").dict(), sd.at("optim").dict());
  std::printf("consumer: rank %d of %d ok, loss %.4f\n", pg.rank(), pg.size(), loss.item<float>());
  return 0;
}
