// bench_checkpoint: checkpoint save and load bandwidth at world size 2 (or $FSDP_BENCH_WORLD),
// each next to its physical baseline measured in the same run on the same bytes, and next to
// LibTorch's torch::save / torch::load and Python's torch.save / torch.load of the same full state
// dict:
//   save  (every rank writes its shards, fsync, atomic commit)  vs  raw write + fsync per rank
//   load  (every rank reads and checks its shards)               vs  raw pread per rank
//   load with a group (LoadOptions::group) of the same shards      vs  load
//   every rank loading the whole state (what each HYBRID_SHARD replica needs of its pieces):
//     collectively, each byte read once and sent over c10d          vs  each rank reading it all
//   torch::save / torch::load of the whole dict on rank 0 (no fsync: what LibTorch does)
//   Python torch.save / torch.load of the same dict (a subprocess, if /usr/bin/python3 has torch)
//   AsyncSaver::save: how long the caller is blocked, against a synchronous save
//   export_safetensors of the checkpoint on rank 0  vs  raw write + fsync of the same bytes there
// Files go to $FSDP_BENCH_DIR (default /var/tmp), a real disk rather than a tmpfs. Reads are from
// the page cache right after writing, for both sides alike.
#include <fcntl.h>
#include <sys/stat.h>
#include <torch/serialize.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "bench_ranks.h"
#include "fsdp/checkpoint/async_save.h"
#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/checkpoint/export.h"

namespace ckpt = fsdp::checkpoint;

namespace {

constexpr int kTensors = 8;
constexpr int64_t kRowsPerRank = 512, kCols = 4096;  // 8 MiB per tensor per rank

// Set by main before the ranks are forked, so that all agree on it.
std::string& base_dir_ref() {
  static std::string dir;
  return dir;
}
const std::string& base_dir() { return base_dir_ref(); }

int world() { return fsdp_bench::group()->size(); }

int64_t rank_bytes() { return kTensors * kRowsPerRank * kCols * 4; }

// Each rank's shards of kTensors row-sharded float32 tensors.
fsdp::StateDict sharded(int rank, int w) {
  fsdp::StateDict model;
  for (int i = 0; i < kTensors; ++i) {
    at::Tensor local = at::randn({kRowsPerRank, kCols});
    model.insert_or_assign(
        "t" + std::to_string(i),
        fsdp::ShardedTensor(
            {kRowsPerRank * w, kCols}, at::kFloat,
            {{local, fsdp::ShardMetadata{{kRowsPerRank * rank, 0}, {kRowsPerRank, kCols}, rank}}}));
  }
  fsdp::StateDict sd;
  sd.insert_or_assign("model", model);
  return sd;
}

void set_bytes(benchmark::State& st) {
  st.SetBytesProcessed(static_cast<int64_t>(st.iterations()) * rank_bytes() * world());
}

// Every timed write goes to a new file (and every timed save to a new directory), as
// save_step does; the previous one is removed outside the timing, on both sides alike.
void BM_RawWriteFsync(benchmark::State& st) {
  auto& pg = *fsdp_bench::group();
  const std::string dir = base_dir();
  const std::string path = dir + "/raw_" + std::to_string(pg.rank());
  const at::Tensor data = at::randn({rank_bytes() / 4});
  pg.barrier();
  int k = 0;
  for (auto _ : st) {
    const std::string file = path + "_" + std::to_string(k++);
    fsdp_bench::write_file_fsync(file, data.data_ptr(), rank_bytes());
    pg.barrier();  // as a save: done when every rank is
    st.PauseTiming();
    ::rename(file.c_str(), path.c_str());  // the file raw_read reads
    pg.barrier();
    st.ResumeTiming();
  }
  set_bytes(st);
}

void BM_RawRead(benchmark::State& st) {
  auto& pg = *fsdp_bench::group();
  const std::string path = base_dir() + "/raw_" + std::to_string(pg.rank());
  at::Tensor buf = at::empty({rank_bytes() / 4});
  pg.barrier();
  for (auto _ : st) {
    const int fd = ::open(path.c_str(), O_RDONLY);
    char* p = static_cast<char*>(buf.data_ptr());
    int64_t done = 0;
    while (done < rank_bytes()) {
      const auto n = ::pread(fd, p + done, static_cast<size_t>(rank_bytes() - done), done);
      if (n <= 0) throw std::runtime_error("raw read failed");
      done += n;
    }
    ::close(fd);
    pg.barrier();
  }
  set_bytes(st);
}

void BM_Save(benchmark::State& st) {
  auto& pg = *fsdp_bench::group();
  const fsdp::StateDict sd = sharded(pg.rank(), pg.size());
  const std::string dir = base_dir() + "/ckpt";
  ckpt::save(sd, dir);  // what the loads and exports read
  pg.barrier();
  int k = 0;
  for (auto _ : st) {
    const std::string fresh = dir + "_" + std::to_string(k++);
    ckpt::save(sd, fresh);
    st.PauseTiming();
    if (pg.rank() == 0) std::system(("rm -rf " + fresh).c_str());
    pg.barrier();
    st.ResumeTiming();
  }
  set_bytes(st);
}

// Each rank's own shards, loaded on its own (`group` null) or collectively.
void load_shards(benchmark::State& st, fsdp::dist::ProcessGroup* group) {
  auto& pg = *fsdp_bench::group();
  fsdp::StateDict sd = sharded(pg.rank(), pg.size());
  const std::string dir = base_dir() + "/ckpt";
  pg.barrier();
  for (auto _ : st) {
    ckpt::load(sd, dir, ckpt::LoadOptions().group(group));
    pg.barrier();
  }
  set_bytes(st);
}
void BM_Load(benchmark::State& st) { load_shards(st, nullptr); }
void BM_LoadGroup(benchmark::State& st) { load_shards(st, fsdp_bench::group()); }

// The whole state on every rank (plain tensors), loaded by each rank on its own (`group` null:
// every rank reads every byte) or collectively (each byte read once, by the rank that saved it,
// and sent to the others).
void load_whole(benchmark::State& st, fsdp::dist::ProcessGroup* group) {
  auto& pg = *fsdp_bench::group();
  fsdp::StateDict model;
  for (int i = 0; i < kTensors; ++i)
    model.insert_or_assign("t" + std::to_string(i), at::empty({kRowsPerRank * pg.size(), kCols}));
  fsdp::StateDict sd;
  sd.insert_or_assign("model", model);
  const std::string dir = base_dir() + "/ckpt";
  pg.barrier();
  for (auto _ : st) {
    ckpt::load(sd, dir, ckpt::LoadOptions().group(group));
    pg.barrier();
  }
  set_bytes(st);
}
void BM_LoadWholeEach(benchmark::State& st) { load_whole(st, nullptr); }
void BM_LoadWholeGroup(benchmark::State& st) { load_whole(st, fsdp_bench::group()); }

// How long an AsyncSaver blocks the caller (the CPU snapshot); the background write is waited for
// outside the timing.
void BM_AsyncSaveBlocked(benchmark::State& st) {
  auto& pg = *fsdp_bench::group();
  const fsdp::StateDict sd = sharded(pg.rank(), pg.size());
  const std::string dir = base_dir() + "/ckpt_async";
  ckpt::AsyncSaver saver;
  saver.save(sd, dir);  // allocates the staging buffers
  saver.wait();
  pg.barrier();
  for (auto _ : st) {
    saver.save(sd, dir);
    st.PauseTiming();
    saver.wait();
    pg.barrier();
    st.ResumeTiming();
  }
  set_bytes(st);
}

// The same bytes as one full state dict on rank 0, through LibTorch's own serializer.
void BM_TorchSave(benchmark::State& st) {
  auto& pg = *fsdp_bench::group();
  const std::string path = base_dir() + "/torch_save.pt";
  std::vector<at::Tensor> full;
  if (pg.rank() == 0)
    for (int i = 0; i < kTensors; ++i) full.push_back(at::randn({kRowsPerRank * pg.size(), kCols}));
  pg.barrier();
  for (auto _ : st) {
    if (pg.rank() == 0) torch::save(full, path);
    pg.barrier();
  }
  set_bytes(st);
}

void BM_TorchLoad(benchmark::State& st) {
  auto& pg = *fsdp_bench::group();
  const std::string path = base_dir() + "/torch_save.pt";
  pg.barrier();
  for (auto _ : st) {
    if (pg.rank() == 0) {
      std::vector<at::Tensor> full;
      torch::load(full, path);
    }
    pg.barrier();
  }
  set_bytes(st);
}

// Python's torch.save / torch.load of the same dict once, timed by Python itself (so that the
// interpreter's start-up does not count).
std::pair<double, double> python_save_load(int w) {
  std::ostringstream script;
  script << "import time, torch\n"
         << "sd = {f't{i}': torch.randn(" << kRowsPerRank * w << ", " << kCols
         << ") for i in range(" << kTensors << ")}\n"
         << "p = '" << base_dir() << "/py_save.pt'\n"
         << "t = time.perf_counter(); torch.save(sd, p); s = time.perf_counter() - t\n"
         << "t = time.perf_counter(); torch.load(p); l = time.perf_counter() - t\n"
         << "print(s, l)\n";
  const std::string cmd = "/usr/bin/python3 -c \"" + script.str() + "\" 2>/dev/null";
  FILE* p = popen(cmd.c_str(), "r");
  double save = 0, load = 0;
  if (p) {
    if (std::fscanf(p, "%lf %lf", &save, &load) != 2) save = load = 0;
    pclose(p);
  }
  return {save, load};
}

// Rank 0's Python torch.save / torch.load seconds, one pair per round (the case's own time,
// which includes the interpreter's start, is not used).
std::vector<double>& py_save() {
  static std::vector<double> v;
  return v;
}
std::vector<double>& py_load() {
  static std::vector<double> v;
  return v;
}

void BM_Python(benchmark::State& st) {
  auto& pg = *fsdp_bench::group();
  for (auto _ : st) {
    if (pg.rank() == 0) {
      const auto [save, load] = python_save_load(pg.size());
      if (save > 0) {
        py_save().push_back(save);
        py_load().push_back(load);
      }
    }
    pg.barrier();
  }
}

// export_safetensors of the whole checkpoint on rank 0 (one file, fsynced), against rank 0 alone
// writing and fsyncing the same bytes.
void BM_ExportSafetensors(benchmark::State& st) {
  auto& pg = *fsdp_bench::group();
  const std::string out = base_dir() + "/export";
  pg.barrier();
  for (auto _ : st) {
    if (pg.rank() == 0) ckpt::export_safetensors(base_dir() + "/ckpt", out);
    pg.barrier();
  }
}

void BM_RawWriteFull(benchmark::State& st) {
  auto& pg = *fsdp_bench::group();
  const std::string path = base_dir() + "/raw_full";
  const int64_t bytes = rank_bytes() * pg.size();
  at::Tensor data;
  if (pg.rank() == 0) data = at::ones({bytes / 4});
  pg.barrier();
  for (auto _ : st) {
    if (pg.rank() == 0) fsdp_bench::write_file_fsync(path, data.data_ptr(), bytes);
    pg.barrier();
  }
}

void register_all(int rounds) {
  // The first save creates the checkpoint that loads and exports read; the first round runs in
  // order, so each raw read and torch::load finds its file written.
  fsdp_bench::register_rounds({{"save", BM_Save, 0, 1}}, 1);
  fsdp_bench::register_rounds({{"raw_write_fsync", BM_RawWriteFsync, 0, 3},
                               {"save", BM_Save, 0, 3},
                               {"raw_read", BM_RawRead, 0, 3},
                               {"load", BM_Load, 0, 3},
                               {"load_group", BM_LoadGroup, 0, 3},
                               {"load_whole_each", BM_LoadWholeEach, 0, 1},
                               {"load_whole_group", BM_LoadWholeGroup, 0, 1},
                               {"async_save_blocked", BM_AsyncSaveBlocked, 0, 3},
                               {"torch_save", BM_TorchSave, 0, 3},
                               {"torch_load", BM_TorchLoad, 0, 3},
                               {"python", BM_Python, 0, 1},
                               {"raw_write_full", BM_RawWriteFull, 0, 1},
                               {"export_safetensors", BM_ExportSafetensors, 0, 1}},
                              rounds);
}

void summarize(const fsdp_bench::RecordingReporter& rep, int w) {
  const double mb = static_cast<double>(rank_bytes()) * w / 1e6;
  auto bw = [&](double s) { return s > 0 ? mb / s : 0.0; };
  const double save = rep.get("save"), raw_w = rep.get("raw_write_fsync");
  const double load = rep.get("load"), raw_r = rep.get("raw_read");
  const double ts = rep.get("torch_save"), tl = rep.get("torch_load");
  const double ps = fsdp_bench::median(py_save()), pl = fsdp_bench::median(py_load());
  std::printf(
      "\n%d ranks, %.0f MB of float32 in all (%d tensors of %.0f MB); medians of "
      "interleaved rounds\n",
      w, mb, kTensors, mb / kTensors);
  std::printf("%-44s %10s %10s %8s\n", "", "ms", "MB/s", "ratio");
  auto row = [&](const char* what, double s, double base) {
    std::printf("%-44s %10.1f %10.0f %8.2f\n", what, s * 1e3, bw(s), base > 0 ? s / base : 0.0);
  };
  row("raw write+fsync, every rank (baseline)", raw_w, raw_w);
  row("checkpoint::save (atomic, checksummed)", save, raw_w);
  row("raw pread, every rank (baseline)", raw_r, raw_r);
  row("checkpoint::load (checksums verified)", load, raw_r);
  row("checkpoint::load, group (read once)", rep.get("load_group"), load);
  std::printf("the whole state on every rank, ratio to each rank reading it all:\n");
  row("each rank reads every byte (baseline)", rep.get("load_whole_each"),
      rep.get("load_whole_each"));
  row("group: each byte read once, then sent", rep.get("load_whole_group"),
      rep.get("load_whole_each"));
  std::printf("full state dict on one process (no fsync), ratio to checkpoint::save / load:\n");
  row("torch::save", ts, save);
  row("torch::load", tl, load);
  if (ps > 0) {
    row("Python torch.save", ps, save);
    row("Python torch.load", pl, load);
  } else {
    std::printf(
        "Python torch.save / torch.load: skipped, no /usr/bin/python3 with torch here "
        "(scripts/bench.sh also runs this program in the LibTorch 2.6 chroot, which has "
        "it)\n");
  }
  std::printf("training blocked by a save, ratio to checkpoint::save:\n");
  row("AsyncSaver::save (CPU snapshot)", rep.get("async_save_blocked"), save);
  std::printf("export of the whole checkpoint on rank 0, ratio to raw write+fsync there:\n");
  row("raw write+fsync, rank 0 (baseline)", rep.get("raw_write_full"), rep.get("raw_write_full"));
  row("export_safetensors", rep.get("export_safetensors"), rep.get("raw_write_full"));

  auto emit = [&](const char* c, const std::vector<double>& samples) {
    if (samples.empty()) return;
    fsdp_bench::emit({{"bench", "checkpoint"},
                      {"case", c},
                      {"world", w},
                      {"unit", "s"},
                      {"bytes", rank_bytes() * w}},
                     samples);
  };
  for (const char* c : {"raw_write_fsync", "save", "raw_read", "load", "load_group",
                        "load_whole_each", "load_whole_group", "async_save_blocked", "torch_save",
                        "torch_load", "raw_write_full", "export_safetensors"})
    emit(c, rep.all(c));
  emit("python_torch_save", py_save());
  emit("python_torch_load", py_load());
}

}  // namespace

int main(int argc, char** argv) {
  const int w = fsdp_bench::world_from_env();
  const char* d = std::getenv("FSDP_BENCH_DIR");
  base_dir_ref() =
      std::string(d ? d : "/var/tmp") + "/fsdp_bench_ckpt_" + std::to_string(::getpid());
  ::mkdir(base_dir().c_str(), 0755);
  const int rounds = fsdp_bench::rounds_from_env(3);
  const int rc = fsdp_bench::run(
      argc, argv, w, [&] { register_all(rounds); },
      [w](const fsdp_bench::RecordingReporter& rep) { summarize(rep, w); });
  std::system(("rm -rf " + base_dir()).c_str());
  return rc;
}
