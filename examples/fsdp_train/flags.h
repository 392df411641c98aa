// fsdp-train's command line: the flags, their presets, and the checks every rank makes alone.
#pragma once

#include <unistd.h>

#include <CLI/CLI.hpp>

#include <array>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>

#include "fsdp/compat_optim.h"

namespace fsdp_train {

struct Flags {
  int64_t steps = 300;
  uint64_t seed = 1337;
  int64_t global_batch = 12;
  int64_t seq_len = 64;
  int64_t layers = 2;
  int64_t dim = 64;
  int64_t heads = 4;
  std::string model = "";          // a preset of layers, dim and heads (model_presets)
  std::string init = "deferred";   // deferred: no rank builds the whole model (wrap_deferred)
  std::string device = "auto";     // after resolve_device: "cpu" or "cuda:<index>"
  std::string attention = "auto";  // after resolve_device: "math" or "fused"
  std::string sharding = "full_shard";
  int use_orig_params = 0;
  std::string mixed_precision = "none";
  std::string activation_checkpointing = "none";  // full: every block recomputed in backward
  std::string optimizer = "adamw";
  int foreach = 1;  // AdamW as multi-tensor operations (fsdp::ForeachAdamW): PyTorch's foreach=True
  int fused = 0;    // AdamW as ATen's _fused_adamw_ (AdamWKernel::kFused): PyTorch's fused=True
  bool compute_only = false;       // the unwrapped model, no FSDP and no communication
  std::string sync_debug = "off";  // CUDA's sync debug mode during the steps: off, warn, error
  double lr = 3e-3;
  double momentum = 0.9;  // SGD's; 0 keeps no optimizer state at all
  std::string save_dir;
  int64_t save_every = 0;
  int keep_last = 3;
  bool async_save = false;
  bool node_local = false;
  int replicas = 1;
  std::string mem_dir;
  int64_t mem_every = 1;
  bool resume = false;
  std::string export_file;
  std::string eval_logits;
  int64_t log_every = 10;
  std::string metrics;
  std::string data = "/usr/share/common-licenses/GPL-3";
  int timeout_s = 600;
  int mmap_threshold_kb = 128;  // glibc's: fixed, so freed unit-sized buffers go back at once
  double peak_tflops = 0;       // per rank; 0: the GPU's from the table (device.h), else no MFU
  std::string peak_source;      // after resolve_device: where peak_tflops came from
};

// One line on stderr and a non-zero exit; used before any collective, where every rank reaches
// the same verdict alone. Every rank prints it: a launcher stops the others as soon as the
// first rank exits, so only the ranks that got that far can say why.
[[noreturn]] inline void fail(const std::string& msg, int code = 2) {
  std::fprintf(stderr, "fsdp-train: error: %s\n", msg.c_str());
  std::exit(code);
}

// --model's layers, dim and heads (GPT-2's shapes from medium on), where the flags did not set
// them.
inline void apply_model_preset(const CLI::App& app, Flags& f) {
  if (f.model.empty()) return;
  const std::map<std::string, std::array<int64_t, 3>> presets = {
      {"tiny", {2, 64, 4}},      {"small", {6, 384, 6}}, {"medium", {12, 768, 12}},
      {"large", {24, 1024, 16}}, {"xl", {24, 1536, 16}}, {"xxl", {20, 2048, 16}}};
  const auto& p = presets.at(f.model);
  if (app.count("--layers") == 0) f.layers = p[0];
  if (app.count("--dim") == 0) f.dim = p[1];
  if (app.count("--heads") == 0) f.heads = p[2];
}

// The flags of saving and resuming: --save-dir and the rest.
inline void add_checkpoint_flags(CLI::App& app, Flags& f) {
  constexpr int64_t kMax = int64_t{1} << 40;
  app.add_option("--save-dir", f.save_dir, "Checkpoint root (step_<N> directories, `latest`)");
  app.add_option("--save-every", f.save_every, "Save every K steps (and at the end)")
      ->check(CLI::Range(int64_t{0}, kMax));
  app.add_option("--keep-last", f.keep_last, "Checkpoints to keep (0: all)")
      ->check(CLI::Range(0, 1000000));
  app.add_flag("--async-save", f.async_save, "Save in the background while training goes on");
  app.add_flag("--node-local", f.node_local,
               "Hosts do not share --save-dir: each keeps its own ranks' files (a resume reads "
               "every host's)");
  app.add_option("--replicas", f.replicas,
                 "With --node-local: how many hosts hold each data file (2: a host's disk can be "
                 "lost)")
      ->check(CLI::Range(1, 1000));
  app.add_option("--mem-dir", f.mem_dir,
                 "In-memory checkpoints: every --mem-every steps each host keeps its ranks' "
                 "shards here (a directory of this job on a tmpfs, e.g. /dev/shm/JOB, on each "
                 "host) and a copy of the previous host's; --resume takes them when at least "
                 "as new as --save-dir's. Emptied of them at the end");
  app.add_option("--mem-every", f.mem_every, "In-memory checkpoint every K steps")
      ->check(CLI::Range(int64_t{1}, kMax));
  app.add_flag("--resume", f.resume,
               "Continue from the latest checkpoint in --save-dir (or --mem-dir, if newer)");
}

// Where and how fast: the device, the attention kernel, and the peak MFU is counted against.
inline void add_device_flags(CLI::App& app, Flags& f) {
  app.add_option("--device", f.device,
                 "auto: this local rank's GPU when LibTorch sees one (NCCL), else the CPU (Gloo)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  app.add_option("--attention", f.attention,
                 "fused: LibTorch 2.x's scaled_dot_product_attention; math: softmax(q k^T) v; "
                 "auto: fused on a GPU, math on the CPU")
      ->check(CLI::IsMember({"auto", "math", "fused"}));
  app.add_option("--peak-tflops", f.peak_tflops,
                 "The device's peak TFLOP/s per rank in the run's dtype: adds MFU to the log and "
                 "--metrics (examples/fsdp_train/flops.h counts the FLOPs)")
      ->check(CLI::Range(0.0, 1e6));
  app.add_option("--sync-debug", f.sync_debug,
                 "CUDA's synchronisation debug mode during the training steps (not the logging): "
                 "warn or error at every operation that makes the host wait for the GPU; no "
                 "effect on the CPU")
      ->check(CLI::IsMember({"off", "warn", "error"}));
  app.add_flag("--compute-only", f.compute_only,
               "Train the unwrapped model on this rank's rows, with no FSDP and no communication "
               "(bf16: bf16 weights, float32 master weights and optimizer): the compute an FSDP "
               "step cannot do without, to set its speed against. Each rank trains its own copy");
}

// The command line, parsed and checked. Exits on --help (0) or a bad flag (2).
inline Flags parse_flags(int argc, char** argv, int rank) {
  constexpr int64_t kMax = int64_t{1} << 40;
  Flags f;
  CLI::App app{"fsdp-train: train a small byte-level GPT with fsdp-cpp (run it under fsdp-run)",
               "fsdp-train"};
  app.add_option("--steps", f.steps, "Last step to train to")->check(CLI::Range(int64_t{0}, kMax));
  app.add_option("--seed", f.seed, "Seed of the initial weights and of every batch");
  app.add_option("--global-batch", f.global_batch, "Sequences per step, over all ranks")
      ->check(CLI::Range(int64_t{1}, kMax));
  app.add_option("--seq-len", f.seq_len, "Bytes per sequence")->check(CLI::Range(int64_t{1}, kMax));
  app.add_option("--layers", f.layers, "Transformer blocks (one FSDP unit each)")
      ->check(CLI::Range(int64_t{0}, kMax));
  app.add_option("--dim", f.dim, "Model width")->check(CLI::Range(int64_t{1}, kMax));
  app.add_option("--heads", f.heads, "Attention heads (must divide --dim)")
      ->check(CLI::Range(int64_t{1}, kMax));
  app.add_option("--model", f.model,
                 "Size preset: tiny (2 x 64, 0.1M parameters), small (6 x 384, 11M), medium "
                 "(12 x 768, 85M), large (24 x 1024, 303M), xl (24 x 1536, 680M), xxl (20 x 2048, "
                 "1.0B); --layers, "
                 "--dim and --heads override it")
      ->check(CLI::IsMember({"tiny", "small", "medium", "large", "xl", "xxl"}));
  app.add_option("--init", f.init,
                 "deferred: each rank builds only its shards of the model (wrap_deferred); eager: "
                 "every rank builds it whole first")
      ->check(CLI::IsMember({"deferred", "eager"}));
  app.add_option("--sharding", f.sharding, "Sharding strategy")
      ->check(CLI::IsMember({"full_shard", "shard_grad_op", "no_shard", "hybrid_shard"}));
  app.add_option("--use-orig-params", f.use_orig_params, "Optimize the original parameters")
      ->check(CLI::Range(0, 1));
  app.add_option("--mixed-precision", f.mixed_precision, "Compute dtype")
      ->check(CLI::IsMember({"none", "bf16"}));
  app.add_option("--activation-checkpointing", f.activation_checkpointing,
                 "full: keep only each block's input in forward and recompute the block in "
                 "backward (about a third more compute, activations down to the blocks' inputs)")
      ->check(CLI::IsMember({"none", "full"}));
  app.add_option("--optimizer", f.optimizer, "Optimizer")
      ->check(CLI::IsMember({"adamw", "adam", "sgd"}));
  app.add_option("--foreach", f.foreach,
                 "AdamW's step as multi-tensor operations (fsdp::ForeachAdamW; bit for bit "
                 "LibTorch's AdamW on the CPU); 0: LibTorch's tensor-by-tensor AdamW")
      ->check(CLI::Range(0, 1));
  app.add_option("--fused", f.fused,
                 "AdamW's step as ATen's _fused_adamw_, one kernel per list of tensors "
                 "(fsdp::AdamWKernel::kFused; LibTorch 2.4 or later)")
      ->check(CLI::Range(0, 1));
  app.add_option("--lr", f.lr, "Learning rate")->check(CLI::Range(1e-12, 1e6));
  app.add_option("--momentum", f.momentum,
                 "SGD's momentum (0: plain SGD, no optimizer state; the default 0.9 keeps a "
                 "buffer the size of the parameters)")
      ->check(CLI::Range(0.0, 1.0));
  add_checkpoint_flags(app, f);
  app.add_option("--export", f.export_file,
                 "Consolidated weights at the end: FILE.pt (torch.load) or safetensors");
  app.add_option("--eval-logits", f.eval_logits,
                 "Write the final model's logits on the corpus's first --seq-len bytes (.pt)");
  app.add_option("--log-every", f.log_every, "Log every K steps")
      ->check(CLI::Range(int64_t{1}, kMax));
  app.add_option("--metrics", f.metrics, "Append one JSON object per logged step to FILE");
  app.add_option("--data", f.data, "Text corpus");
  app.add_option("--mmap-threshold-kb", f.mmap_threshold_kb,
                 "Fix glibc's mmap threshold at K KiB, so that freed buffers of that size and up "
                 "return to the system at once (0: glibc's default, which raises the threshold "
                 "up to 32 MiB as buffers are freed and then keeps them; docs/deferred_init.md)")
      ->check(CLI::Range(0, 32 * 1024));
  add_device_flags(app, f);
  app.add_option("--timeout", f.timeout_s, "Seconds before a collective gives up")
      ->check(CLI::Range(1, 1000000));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) std::exit(rank == 0 ? app.exit(e) : 0);  // --help
    fail(e.what());
  }
  apply_model_preset(app, f);
  return f;
}

// Everything a rank can check alone, before any collective: every rank reaches the same
// verdict, so a bad flag exits everywhere instead of leaving ranks waiting for each other.
inline void check_flags(const Flags& f, int world) {
  if (f.dim % f.heads != 0)
    fail("--heads " + std::to_string(f.heads) + " does not divide --dim " + std::to_string(f.dim));
  if (f.global_batch % world != 0)
    fail("--global-batch " + std::to_string(f.global_batch) +
         " is not divisible by the world size " + std::to_string(world));
  if ((f.save_every > 0 || f.resume || f.async_save) && f.save_dir.empty())
    fail("--save-every, --resume and --async-save need --save-dir");
  if (f.replicas > 1 && !f.node_local) fail("--replicas needs --node-local");
  if (!f.mem_dir.empty() && f.mem_dir == f.save_dir)
    fail("--mem-dir must differ from --save-dir (it keeps only the newest step)");
  if (f.fused && f.optimizer != "adamw") fail("--fused 1 is AdamW's: it needs --optimizer adamw");
  if (f.fused && !fsdp::compat::kHasFusedAdamW)
    fail("--fused 1: this LibTorch (" + std::string(TORCH_VERSION) +
         ") has no _fused_adamw_ (2.4 and later have); use --fused 0");
  // The compute-only step has no FSDP state to save, resume, export or checkpoint through.
  if (f.compute_only && (!f.save_dir.empty() || !f.mem_dir.empty() || !f.export_file.empty() ||
                         !f.eval_logits.empty() || f.activation_checkpointing != "none"))
    fail(
        "--compute-only trains the unwrapped model: it takes no --save-dir, --mem-dir, --resume, "
        "--export, --eval-logits or --activation-checkpointing");
  // Files only rank 0 writes: every rank checks their folder, so that none is left waiting.
  for (const std::string& out : {f.metrics, f.export_file, f.eval_logits}) {
    if (out.empty()) continue;
    const size_t slash = out.find_last_of('/');
    const std::string folder = slash == std::string::npos ? "." : out.substr(0, slash + 1);
    if (::access(folder.c_str(), W_OK) != 0)
      fail("cannot write " + out + ": " + folder + ": " + std::strerror(errno));
  }
}

}  // namespace fsdp_train
