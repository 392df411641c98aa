// fsdp-train: an example trainer built only on fsdp-cpp's public API (issue 12). It trains the
// byte-level GPT of gpt.h on a text file, checkpoints, resumes at any world size and exports.
//
//   fsdp-run --nproc-per-node 2 fsdp-train --steps 200 --save-dir ckpt --save-every 50
//   fsdp-run --nproc-per-node 3 fsdp-train --steps 300 --save-dir ckpt --resume --export model.pt
//
// What makes runs comparable across world sizes: the batch of step s is drawn from a generator
// seeded by (--seed, s) alone, the same on every rank and at every world size; rank r of W takes
// rows [r*B/W, (r+1)*B/W) of the global batch of B rows; each rank's loss is the mean over its
// rows and FSDP averages gradients over ranks, so every step follows the global-batch gradient
// whatever W is. The logged loss is the global-batch loss (the ranks' losses averaged).
//
// Checkpoints (model, optimizer, and the trainer's step and data position) go through
// fsdp::checkpoint into <save-dir>/step_<N> with a `latest` pointer; --resume continues from the
// newest complete one whatever world size, sharding strategy or use_orig_params wrote it. With
// --mem-dir, every --mem-every steps the same state also goes, in the background, to an in-memory
// checkpoint on each host (a tmpfs) with a copy on the next host, which a resume prefers when it
// is at least as new and no file of it was lost.
#include <unistd.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iterator>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "device.h"
#include "flags.h"
#include "flops.h"
#include "fsdp/checkpoint/async_save.h"
#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/checkpoint/export.h"
#include "fsdp/checkpoint/state_dict.h"
#include "fsdp/fsdp.h"
#include "gpt.h"
#include "plain_step.h"

namespace ckpt = fsdp::checkpoint;

namespace {

using namespace fsdp_train;  // NOLINT(build/namespaces): the trainer's own headers

std::string read_corpus(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail("cannot read --data " + path + ": " + std::strerror(errno));
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (f.bad()) fail("reading --data " + path + " failed");
  return text;
}

// Rows [lo, hi) of the global batch of a step: inputs and next-byte targets, [rows, T] each,
// and where in the corpus the global batch's first row starts (its data position, logged so
// that a resumed run can be shown to read the batches an uninterrupted one reads).
struct Batch {
  torch::Tensor x, y;
  int64_t first_offset;
};

Batch batch(const torch::Tensor& corpus, const Flags& f, int64_t step, int64_t lo, int64_t hi) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(f.seed * 1000003ULL + step);
  const int64_t span = corpus.numel() - f.seq_len - 1;  // > 0, checked at start
  const auto starts = torch::randint(span + 1, {f.global_batch}, gen, torch::kLong);
  std::vector<torch::Tensor> x, y;
  for (int64_t r = lo; r < hi; ++r) {
    const int64_t s = starts[r].item<int64_t>();
    x.push_back(corpus.narrow(0, s, f.seq_len));
    y.push_back(corpus.narrow(0, s + 1, f.seq_len));
  }
  return {torch::stack(x), torch::stack(y), starts[0].item<int64_t>()};
}

fsdp::ShardingStrategy strategy_of(const std::string& s) {
  if (s == "full_shard") return fsdp::ShardingStrategy::FULL_SHARD;
  if (s == "shard_grad_op") return fsdp::ShardingStrategy::SHARD_GRAD_OP;
  if (s == "no_shard") return fsdp::ShardingStrategy::NO_SHARD;
  return fsdp::ShardingStrategy::HYBRID_SHARD;
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const Flags& f,
                                                        std::vector<torch::Tensor> params) {
  if (f.optimizer == "adam")
    return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(f.lr));
  if (f.optimizer == "sgd")
    return std::make_unique<torch::optim::SGD>(params,
                                               torch::optim::SGDOptions(f.lr).momentum(f.momentum));
  const auto adamw = torch::optim::AdamWOptions(f.lr).betas({0.9, 0.95}).weight_decay(0.1);
  if (f.fused)
    return std::make_unique<fsdp::ForeachAdamW>(params, adamw, fsdp::AdamWKernel::kFused);
  if (f.foreach) return std::make_unique<fsdp::ForeachAdamW>(params, adamw);
  return std::make_unique<torch::optim::AdamW>(params, adamw);
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// The consolidated weights (on rank 0) to FILE: `.pt` for torch.load, else safetensors (FILE
// ending in .safetensors: that file; otherwise a directory holding model.safetensors).
void export_weights(const fsdp::StateDict& full, const std::string& file) {
  if (ends_with(file, ".pt")) {
    ckpt::save_pt(full, file, ckpt::ExportOptions().prefix(""));
    return;
  }
  if (!ends_with(file, ".safetensors")) {
    ckpt::save_safetensors(full, file, ckpt::ExportOptions().prefix(""));
    return;
  }
  const std::string tmp = file + ".dir.partial";
  const auto files = ckpt::save_safetensors(full, tmp, ckpt::ExportOptions().prefix(""));
  if (files.size() != 1 || std::rename(files[0].c_str(), file.c_str()) != 0)
    throw std::runtime_error("could not move " + (files.empty() ? tmp : files[0]) + " to " + file);
  ::rmdir(tmp.c_str());
}

// The corpus as one byte per element (int64, for narrow and cross_entropy), checked long enough
// for one sequence. `text` keeps the bytes the tensor was made from.
torch::Tensor load_corpus(const Flags& f, std::string& text) {
  text = read_corpus(f.data);
  if (text.empty()) fail("--data " + f.data + " is empty");
  if (static_cast<int64_t>(text.size()) < f.seq_len + 1)
    fail("--seq-len " + std::to_string(f.seq_len) + " needs at least " +
         std::to_string(f.seq_len + 1) + " bytes of data; " + f.data + " has " +
         std::to_string(text.size()));
  return torch::from_blob(const_cast<char*>(text.data()), {static_cast<int64_t>(text.size())},
                          torch::kUInt8)
      .to(torch::kLong);
}

gpt::Config model_config(const Flags& f) {
  gpt::Config cfg;
  cfg.seq_len = f.seq_len;
  cfg.layers = f.layers;
  cfg.dim = f.dim;
  cfg.heads = f.heads;
  cfg.fused_attention = f.attention == "fused";
  return cfg;
}

fsdp::FullyShardedOptions wrap_options(const Flags& f) {
  auto options = fsdp::FullyShardedOptions()
                     .auto_wrap_policy(fsdp::module_type_auto_wrap_policy<gpt::BlockImpl>())
                     .sharding_strategy(strategy_of(f.sharding))
                     .use_orig_params(f.use_orig_params != 0);
  if (f.device != "cpu") options.device_id(at::Device(f.device));
  if (f.mixed_precision == "bf16")
    options.mixed_precision(
        fsdp::MixedPrecision().param_dtype(torch::kBFloat16).reduce_dtype(torch::kFloat));
  return options;
}

// The wrapped model. Deferred (the default), no rank ever holds it whole: each builds only its
// shards, bit for bit those of the eagerly built model (fsdp/deferred_init.h).
// With --activation-checkpointing full every unit but the root (each block) is checkpointed.
fsdp::FullyShardedDataParallel build_model(const Flags& f, const gpt::Config& cfg) {
  fsdp::FullyShardedDataParallel model =
      f.init == "eager"
          ? fsdp::FullyShardedDataParallel(gpt::GPT(cfg, f.seed), wrap_options(f))
          : fsdp::wrap_deferred([&] { return gpt::GPT(cfg, f.seed); }, wrap_options(f));
  if (f.activation_checkpointing == "full") {
    fsdp::apply_activation_checkpointing(model, fsdp::checkpoint_units());
  }
  return model;
}

// One training run: the wrapped model and its optimizer, the step, checkpoints and the log.
class Trainer {
 public:
  Trainer(const Flags& f, const torch::Tensor& corpus, fsdp::dist::ProcessGroup& pg, int rank,
          int world)
      : f_(f),
        corpus_(corpus),
        pg_(pg),
        rank_(rank),
        world_(world),
        cfg_(model_config(f)),
        model_(f.compute_only ? fsdp::FullyShardedDataParallel(nullptr) : build_model(f, cfg_)),
        plain_(f.compute_only ? std::make_unique<PlainModel>(gpt::GPT(cfg_, f.seed), device_,
                                                             f.mixed_precision == "bf16")
                              : nullptr),
        opt_(make_optimizer(
            f, plain_ ? plain_->optimizer_params() : unique_params(model_->parameters()))) {
    if (f.async_save) saver_.emplace(disk_options());
    // The newest step only, on every host with a copy on the next one, written in the background.
    if (!f.mem_dir.empty())
      mem_saver_.emplace(ckpt::SaveOptions().keep_last(1).node_local(true).replicas(2));
  }

  // Trains to --steps (resuming first with --resume), saves the final state, exports.
  void run() {
    report_startup();
    if (rank_ == 0 && !plain_) describe_units();
    if (f_.resume) resume();
    reset_cuda_peak_of(device_);  // the steps' own peak: not start-up's, nor loading a checkpoint
    open_metrics();
    saved_at_ = step_;
    last_log_ = Clock::now();
    while (step_ < f_.steps) {
      set_sync_debug(f_, true);  // the step itself must not make the host wait (--sync-debug)
      const at::Tensor loss = train_step();
      set_sync_debug(f_, false);  // logging and saving do, by design
      const bool save_now = !f_.save_dir.empty() && f_.save_every > 0 &&
                            (step_ % f_.save_every == 0 || step_ == f_.steps);
      // Logged before it is saved: every step a checkpoint holds is in the log, even when the
      // run dies right after the save (scripts/chaos.py stitches the logs of interrupted runs).
      if (step_ % f_.log_every == 0 || step_ == f_.steps) log(loss);
      if (save_now) save(step_);
      if (mem_saver_ && step_ % f_.mem_every == 0) save_in_memory();
    }
    // Without --save-every, --save-dir still gets the final state.
    if (!f_.save_dir.empty() && saved_at_ != step_) save(step_);
    if (saver_) saver_->wait();  // the last save is committed before we report success
    if (mem_saver_) drop_in_memory();
    if (metrics_) std::fclose(metrics_);
    metrics_ = nullptr;
    if (!f_.export_file.empty() || !f_.eval_logits.empty()) export_results();
  }

  ~Trainer() {
    if (metrics_) std::fclose(metrics_);
  }

 private:
  using Clock = std::chrono::steady_clock;

  // What a checkpoint holds: model, optimizer, and the trainer's own position. The dict of a
  // fresh run is also the template a resume fills (the checkpoint's layout is this run's own).
  fsdp::StateDict state(int64_t at_step) {
    auto [msd, osd] = ckpt::get_state_dict(model_, *opt_);
    fsdp::StateDict trainer;
    trainer.insert_or_assign("step", at_step);
    trainer.insert_or_assign("seed", static_cast<int64_t>(f_.seed));
    trainer.insert_or_assign("global_batch", f_.global_batch);
    trainer.insert_or_assign("seq_len", f_.seq_len);
    fsdp::StateDict sd;
    sd.insert_or_assign("model", std::move(msd));
    sd.insert_or_assign("optim", std::move(osd));
    sd.insert_or_assign("trainer", std::move(trainer));
    return sd;
  }

  // One line on the units: what each gathers per pass, and the root's share (the root unit stays
  // gathered from forward to backward; scripts/host_traffic.py derives the least traffic from it).
  // Every rank's peak resident memory so far (the model built and wrapped, the optimizer made)
  // beside the model's full size: with --init deferred no rank should come near the latter.
  // Collective.
  void report_startup() {
    int64_t elements = plain_ ? plain_->numel() : 0;
    for (fsdp::FlatParamHandle* h :
         plain_ ? std::vector<fsdp::FlatParamHandle*>{} : model_->handles()) {
      if (h) elements += h->layout().unpadded_unsharded_numel;
    }
    torch::Tensor rss = torch::zeros({world_}, torch::kDouble);
    startup_rss_mb_ = max_rss_mb();
    rss[rank_] = startup_rss_mb_;
    pg_.all_reduce(rss);
    reset_peak_rss();  // from here on, VmHWM is the training's peak (--metrics)
    if (rank_ != 0) return;
    std::ostringstream line;
    line << "start-up (--init " << f_.init << "): the model has " << elements << " parameters, "
         << std::fixed << std::setprecision(1) << static_cast<double>(elements) * 4 / 1048576.0
         << " MB in float32; peak rss MB by rank:";
    for (int r = 0; r < world_; ++r) line << " " << rss[r].item<double>();
    std::printf("%s\n", line.str().c_str());
    std::printf("device: %s (%s), attention %s, optimizer %s%s\n", f_.device.c_str(),
                pg_.backend_name().c_str(), f_.attention.c_str(), optimizer_kind().c_str(),
                plain_ ? "; compute only: the unwrapped model, no FSDP, no communication" : "");
    std::ostringstream peak;
    if (f_.peak_tflops > 0) {
      peak << "; peak " << f_.peak_tflops << " TFLOP/s per rank (" << f_.peak_source << ")";
    } else {
      peak << "; no MFU without --peak-tflops (peak " << f_.peak_source << ")";
    }
    std::printf("work: %lld FLOPs per token (6 N + 12 L D T, examples/fsdp_train/flops.h)%s\n",
                static_cast<long long>(gpt::flops_per_token(cfg_, f_.seq_len)), peak.str().c_str());
  }

  std::string optimizer_kind() const {
    if (f_.optimizer != "adamw") return f_.optimizer;
    return f_.fused ? "adamw (fused)" : f_.foreach ? "adamw (foreach)" : "adamw (for-loop)";
  }

  void describe_units() {
    int64_t elements = 0, bytes = 0, root_bytes = 0;
    int units = 0;
    const std::vector<fsdp::FlatParamHandle*> handles = model_->handles();
    for (size_t i = 0; i < handles.size(); ++i) {
      if (handles[i] == nullptr) continue;
      const int64_t n = handles[i]->layout().padded_unsharded_numel;
      const int64_t b = n * static_cast<int64_t>(handles[i]->flat_param().element_size());
      elements += n;
      bytes += b;
      ++units;
      if (i == 0) root_bytes = b;
    }
    std::printf(
        "model: %d FSDP units of %lld parameter elements in all (padded), %lld bytes per "
        "gather of every unit, the root's %lld\n",
        units, static_cast<long long>(elements), static_cast<long long>(bytes),
        static_cast<long long>(root_bytes));
  }

  void resume() {
    // Agreed across the ranks: with node-local checkpoints, a host whose disk is empty follows
    // the others, and a step a crash committed on some hosts only is passed over.
    auto dir = ckpt::agreed_latest_checkpoint(f_.save_dir, pg_);
    if (!f_.mem_dir.empty() && resume_from_memory(dir)) return;
    if (!dir) {
      if (rank_ == 0)
        std::printf("no checkpoint in %s yet: starting from step 0\n", f_.save_dir.c_str());
      return;
    }
    load_from(*dir);
  }

  void load_from(const std::string& dir) {
    fsdp::StateDict sd = state(0);
    // Collective: each stored byte is read once across the job (HYBRID_SHARD's replicas share
    // what they read) and sent to the ranks that need it.
    ckpt::load(sd, dir, ckpt::LoadOptions().group(&pg_));
    ckpt::set_state_dict(model_, *opt_, sd.at("model").dict(), sd.at("optim").dict());
    const fsdp::StateDict& t = sd.at("trainer").dict();
    step_ = t.at("step").to_int();
    if (rank_ == 0 && (t.at("seed").to_int() != static_cast<int64_t>(f_.seed) ||
                       t.at("seq_len").to_int() != f_.seq_len))
      std::fprintf(stderr,
                   "fsdp-train: warning: %s was trained with --seed %lld --seq-len %lld; "
                   "continuing with the batches of --seed %llu --seq-len %lld\n",
                   dir.c_str(), static_cast<long long>(t.at("seed").to_int()),
                   static_cast<long long>(t.at("seq_len").to_int()),
                   static_cast<unsigned long long>(f_.seed), static_cast<long long>(f_.seq_len));
    if (rank_ == 0)
      std::printf("resumed from %s at step %lld (world size %d)\n", dir.c_str(),
                  static_cast<long long>(step_), world_);
  }

  // Resumes from the in-memory checkpoint if it is as new as the disk's `disk` or newer and the
  // hosts hold every file of it (each host's files are also on the next host: losing one host
  // loses nothing, two neighbours can); whether it did. A copy that is damaged or incomplete
  // fails every rank's load together (the collective load's guarantee), and the disk is used.
  bool resume_from_memory(const std::optional<std::string>& disk) {
    const auto mem = ckpt::agreed_latest_checkpoint(f_.mem_dir, pg_);
    if (!mem || (disk && step_of(*mem) < step_of(*disk))) return false;
    const std::string fallback = disk ? *disk : std::string("step 0");
    try {
      const std::vector<std::string> missing = ckpt::missing_files(*mem, pg_);
      if (!missing.empty()) {
        if (rank_ == 0)
          std::printf(
              "in-memory checkpoint %s lost %zu of its data files (%s%s) with their hosts: "
              "resuming from %s\n",
              mem->c_str(), missing.size(), missing.front().c_str(),
              missing.size() > 1 ? ", ..." : "", fallback.c_str());
        return false;
      }
      load_from(*mem);
      return true;
    } catch (const fsdp::ValueError& e) {  // unreadable or damaged: the same on every rank
      if (rank_ == 0)
        std::printf("in-memory checkpoint %s cannot be used (%s): resuming from %s\n", mem->c_str(),
                    e.what(), fallback.c_str());
      return false;
    }
  }

  // The step of a checkpoint directory named `step_<N>` (or `.step_<N>.aside`).
  static int64_t step_of(const std::string& dir) {
    const size_t at = dir.rfind("step_");
    return at == std::string::npos ? -1 : std::atoll(dir.c_str() + at + 5);
  }

  ckpt::SaveOptions disk_options() const {
    return ckpt::SaveOptions()
        .keep_last(f_.keep_last)
        .node_local(f_.node_local)
        .replicas(f_.replicas);
  }

  // In the background, into --mem-dir: only the newest step is kept. Its cost is said once.
  void save_in_memory() {
    mem_saver_->save_step(state(step_), f_.mem_dir, step_);
    if (said_mem_cost_ || rank_ != 0) return;
    said_mem_cost_ = true;
    const double mb = static_cast<double>(mem_saver_->staging_bytes()) / (1 << 20);
    std::printf(
        "in-memory checkpoints every %lld steps in %s: %.1f MB of state on rank 0, held up to "
        "three times per rank (the snapshot, its own files and, across hosts of equal size, a "
        "copy of another host's rank's) and up to five times while a save replaces the last\n",
        static_cast<long long>(f_.mem_every), f_.mem_dir.c_str(), mb);
  }

  // After the last save: the in-memory checkpoints have served, and would hold the host's RAM.
  // Each host's first rank removes what the saves made in --mem-dir. The saver may still be
  // removing an older step in the background (keep_last), so this goes on until nothing of
  // theirs is left (for up to 10 s).
  void drop_in_memory() {
    mem_saver_->wait();
    pg_.barrier();
    if (fsdp::dist::env_info().local_rank != 0) return;
    for (int attempt = 0; attempt < 100; ++attempt) {
      bool left = false;
      std::error_code ec;
      for (const auto& e : std::filesystem::directory_iterator(f_.mem_dir, ec)) {
        const std::string name = e.path().filename().string();
        if (name.rfind("step_", 0) != 0 && name.rfind(".step_", 0) != 0 && name != "latest")
          continue;
        std::error_code gone;
        std::filesystem::remove_all(e.path(), gone);
        left = left || gone;
      }
      if (!left) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }

  void open_metrics() {
    if (rank_ != 0 || f_.metrics.empty()) return;
    metrics_ = std::fopen(f_.metrics.c_str(), step_ > 0 ? "a" : "w");
    if (!metrics_) throw std::runtime_error("cannot write --metrics " + f_.metrics);
  }

  void save(int64_t at_step) {
    saved_at_ = at_step;
    fsdp::StateDict sd = state(at_step);
    if (saver_) {
      saver_->save_step(sd, f_.save_dir, at_step);
    } else {
      ckpt::save_step(sd, f_.save_dir, at_step, disk_options());
    }
  }

  // One optimizer step on this rank's rows of the next global batch; returns this rank's loss.
  at::Tensor train_step() {
    const auto t0 = Clock::now();
    ++step_;
    const int64_t rows = f_.global_batch / world_;
    auto [x_cpu, y_cpu, offset] = batch(corpus_, f_, step_, rank_ * rows, (rank_ + 1) * rows);
    // To a GPU from pinned memory, without waiting (--sync-debug would see a pageable copy wait).
    const bool gpu = device_.is_cuda();
    const at::Tensor x = (gpu ? x_cpu.pin_memory() : x_cpu).to(device_, /*non_blocking=*/gpu);
    const at::Tensor y = (gpu ? y_cpu.pin_memory() : y_cpu).to(device_, /*non_blocking=*/gpu);
    data_offset_ = offset;
    if (plain_) plain_->zero_grad();
    opt_->zero_grad();
    // Compute only, on a GPU: what forward and backward add to the memory the step starts with
    // (activations, gradients, workspace), apart from the optimizer's: gpu-train.sh's bound of the
    // FSDP step's memory takes its activations from it. The peak is folded before each reset.
    const bool measure = plain_ && gpu;
    const double base = measure ? cuda_allocated_mb(device_) : 0;
    if (measure) fold_and_reset_cuda_peak();
    auto logits = plain_ ? plain_->forward(x) : model_->forward(x);
    auto loss = torch::nn::functional::cross_entropy(
        logits.reshape({-1, cfg_.vocab}).to(torch::kFloat), y.reshape({-1}));
    loss.backward();
    if (measure) fwd_bwd_cuda_mb_ = std::max(fwd_bwd_cuda_mb_, cuda_peak_mb(device_) - base);
    if (plain_) plain_->gradients_to_masters();
    opt_->step();
    if (plain_) plain_->masters_to_weights();
    tokens_since_ += f_.global_batch * f_.seq_len;
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    step_seconds_ = step_seconds_ == 0 ? dt : 0.9 * step_seconds_ + 0.1 * dt;
    return loss;
  }

  // The steps' CUDA peak so far into cuda_peak_folded_mb_, and the allocator's peak reset.
  void fold_and_reset_cuda_peak() {
    cuda_peak_folded_mb_ = std::max(cuda_peak_folded_mb_, cuda_peak_mb(device_));
    reset_cuda_peak_of(device_);
  }

  // The global-batch loss, and every rank's peak memory (resident, and CUDA's allocator's on a
  // GPU), in one all_reduce; rank 0 prints them and appends them to --metrics.
  void log(const at::Tensor& loss) {
    auto stats = torch::zeros({1 + 4 * world_}, torch::kDouble);
    stats[1 + 2 * world_ + rank_] =
        std::max(cuda_peak_folded_mb_, cuda_peak_mb(device_));  // CPU: -1
    stats[1 + 3 * world_ + rank_] = fwd_bwd_cuda_mb_;           // -1 unless measured
    stats[0] = loss.detach().item<double>() / world_;
    // VmHWM first: memory may grow between the two reads, and the run's peak covers the steps'.
    const double steps_peak = peak_rss_since_reset_mb();
    stats[1 + world_ + rank_] = steps_peak;
    stats[1 + rank_] =
        std::max({startup_rss_mb_, max_rss_mb(), steps_peak});  // reset forgot start-up's
    pg_.all_reduce(stats);  // staged through the GPU under NCCL (fsdp::dist)
    const double secs = std::chrono::duration<double>(Clock::now() - last_log_).count();
    const double tps = tokens_since_ / std::max(secs, 1e-9);
    last_log_ = Clock::now();
    tokens_since_ = 0;
    if (rank_ == 0) print_log(stats, tps);
  }

  // The ranks' entries [first, first + world) of the log's stats, as a JSON list of whole MB
  // ("null" where a rank has none: -1, CUDA's peak on the CPU).
  std::string per_rank_json(const at::Tensor& stats, int64_t first) const {
    if (stats[first].item<double>() < 0) return "null";
    std::string out = "[";
    for (int r = 0; r < world_; ++r)
      out += (r ? "," : "") + std::to_string(static_cast<int64_t>(stats[first + r].item<double>()));
    return out + "]";
  }

  void print_log(const at::Tensor& stats, double tps) {
    std::ostringstream line;
    line.precision(6);
    line << "step " << step_ << "/" << f_.steps << " | loss " << std::fixed
         << stats[0].item<double>();
    line.unsetf(std::ios::fixed);
    const int64_t flops = gpt::flops_per_token(cfg_, f_.seq_len);
    const double tflops = tps * static_cast<double>(flops) / world_ / 1e12;  // per rank
    const double mfu = gpt::mfu(tps, flops, world_, f_.peak_tflops);
    line << " | " << static_cast<int64_t>(tps) << " tok/s | " << std::setprecision(3) << tflops
         << " TFLOP/s per rank";
    if (mfu > 0) line << " | MFU " << std::setprecision(3) << 100 * mfu << "%";
    line << " | ac " << f_.activation_checkpointing << " | max rss MB";
    const double max_rss = stats.narrow(0, 1, world_).max().item<double>();
    for (int r = 0; r < world_; ++r)
      line << " r" << r << " " << static_cast<int64_t>(stats[1 + r].item<double>());
    if (device_.is_cuda()) {
      line << " | cuda peak MB";
      for (int r = 0; r < world_; ++r)
        line << " r" << r << " " << static_cast<int64_t>(stats[1 + 2 * world_ + r].item<double>());
    }
    if (!f_.save_dir.empty() && f_.save_every > 0) {
      const int64_t next = std::min(f_.steps, (step_ / f_.save_every + 1) * f_.save_every);
      if (next > step_)
        line << " | next checkpoint in " << std::setprecision(2) << (next - step_) * step_seconds_
             << " s";
    }
    std::printf("%s\n", line.str().c_str());
    std::fflush(stdout);
    if (!metrics_) return;
    char mfu_json[32] = "null";  // unknown without a peak
    if (mfu > 0) std::snprintf(mfu_json, sizeof mfu_json, "%.6g", mfu);
    char buf[640];
    std::snprintf(buf, sizeof buf,
                  "{\"step\": %lld, \"loss\": %.9g, \"tokens_per_s\": %.1f, "
                  "\"flops_per_token\": %lld, \"tflops_per_rank\": %.6g, \"mfu\": %s, "
                  "\"max_rss_mb\": %.1f, \"world_size\": %d, \"data_offset\": %lld, "
                  "\"activation_checkpointing\": \"%s\", \"compute_only\": %s, ",
                  static_cast<long long>(step_), stats[0].item<double>(), tps,
                  static_cast<long long>(flops), tflops, mfu_json, max_rss, world_,
                  static_cast<long long>(data_offset_), f_.activation_checkpointing.c_str(),
                  plain_ ? "true" : "false");
    // The run's peaks, the steps' own (since start-up ended), and CUDA's allocator's (the steps').
    std::fprintf(metrics_,
                 "%s\"rss_mb_per_rank\": %s, \"train_rss_mb_per_rank\": %s, "
                 "\"peak_cuda_mb_per_rank\": %s, \"fwd_bwd_cuda_mb_per_rank\": %s}\n",
                 buf, per_rank_json(stats, 1).c_str(), per_rank_json(stats, 1 + world_).c_str(),
                 per_rank_json(stats, 1 + 2 * world_).c_str(),
                 per_rank_json(stats, 1 + 3 * world_).c_str());
    std::fflush(metrics_);
  }

  // --export and --eval-logits, from the consolidated weights (gathered to rank 0).
  void export_results() {
    const auto full_opts = ckpt::StateDictOptions().full_state_dict(true).cpu_offload(true);
    const fsdp::StateDict full = ckpt::get_model_state_dict(model_, full_opts);  // rank 0 only
    if (rank_ != 0) return;
    if (!f_.export_file.empty()) {
      export_weights(full, f_.export_file);
      const bool pt = ends_with(f_.export_file, ".pt");
      const std::string path = pt || ends_with(f_.export_file, ".safetensors")
                                   ? f_.export_file
                                   : f_.export_file + "/model.safetensors";
      std::printf(
          "exported %zu tensors to %s\nload them in Python:\n%s\n", full.size(), path.c_str(),
          (pt ? "  import torch\n  sd = torch.load('" + path + "', weights_only=True)"
              : "  from safetensors.torch import load_file\n  sd = load_file('" + path + "')")
              .c_str());
      std::printf("  # the model: scripts/gpt_reference.py (GPT(...).load_state_dict(sd))\n");
    }
    if (!f_.eval_logits.empty()) {
      // The same model unwrapped in this process, from the consolidated weights: what a Python
      // user gets from the export.
      gpt::GPT plain(cfg_, f_.seed);
      fsdp::load_module_state_dict(*plain, full);
      torch::NoGradGuard no_grad;
      const auto idx = corpus_.narrow(0, 0, f_.seq_len).unsqueeze(0);
      fsdp::StateDict out;
      out.insert_or_assign("input", idx.clone());
      out.insert_or_assign("logits", plain->forward(idx).contiguous());
      ckpt::save_pt(out, f_.eval_logits, ckpt::ExportOptions().prefix(""));
    }
  }

  const Flags& f_;
  const at::Device device_{f_.device};
  const torch::Tensor& corpus_;
  fsdp::dist::ProcessGroup& pg_;
  const int rank_, world_;
  const gpt::Config cfg_;
  fsdp::FullyShardedDataParallel model_;  // null with --compute-only
  std::unique_ptr<PlainModel> plain_;     // --compute-only's unwrapped model, else null
  std::unique_ptr<torch::optim::Optimizer> opt_;
  std::optional<ckpt::AsyncSaver> saver_;
  std::optional<ckpt::AsyncSaver> mem_saver_;  // --mem-dir
  bool said_mem_cost_ = false;
  int64_t step_ = 0;
  int64_t saved_at_ = 0;     // the step of the newest checkpoint (or where we resumed)
  int64_t data_offset_ = 0;  // the last step's data position (Batch::first_offset)
  std::FILE* metrics_ = nullptr;
  Clock::time_point last_log_;
  int64_t tokens_since_ = 0;
  double step_seconds_ = 0;          // moving average, for the time to the next checkpoint
  double startup_rss_mb_ = 0;        // this rank's peak resident set when start-up ended
  double cuda_peak_folded_mb_ = -1;  // the steps' CUDA peak before the last reset (compute only)
  double fwd_bwd_cuda_mb_ = -1;      // compute only on a GPU: the most forward+backward added
};

}  // namespace

int main(int argc, char** argv) {
  const fsdp::dist::EnvInfo env = fsdp::dist::env_info();
  const int rank = env.rank, world = env.world_size;
  Flags f = parse_flags(argc, argv, rank);
  check_flags(f, world);
  resolve_device(f, env);
  fix_mmap_threshold(f.mmap_threshold_kb);
  std::string text;
  const torch::Tensor corpus = load_corpus(f, text);
  try {
    const at::Device device(f.device);
    auto init = fsdp::dist::InitOptions()
                    .backend(device.is_cuda() ? "nccl" : "gloo")
                    .timeout(std::chrono::seconds(f.timeout_s));
    if (device.is_cuda()) init.device_id(device);
    auto pg = fsdp::dist::init_process_group(init);
    Trainer trainer(f, corpus, pg, rank, world);
    trainer.run();
    pg.barrier();
    fsdp::dist::destroy_process_group();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdp-train: error on rank %d: %s\n", rank,
                 std::string(e.what()).substr(0, std::string(e.what()).find('\n')).c_str());
    return 1;
  }
  return 0;
}
