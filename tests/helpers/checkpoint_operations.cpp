// The checkpoint operations under test and their restart checks (checkpoint_operations.h).
#include "checkpoint_operations.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <optional>
#include <stdexcept>

#include "checkpoint/storage/files.h"
#include "fsdp/checkpoint/async_save.h"
#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/checkpoint/export.h"

namespace fsdp {
namespace testing {

namespace ckpt = fsdp::checkpoint;
using fsdp::dist::ProcessGroup;

at::Tensor expected_sharded(double scale) {
  return at::arange(30, at::kFloat).reshape({6, 5}) * scale;
}

std::string holds(const std::string& dir, double scale) {
  try {
    const ckpt::VerifyReport report = ckpt::verify(dir);
    if (!report.ok()) return dir + " does not verify: " + report.problems.front();
    if (!at::equal(load_full_sharded(dir), expected_sharded(scale)))
      return dir + " loads other values";
    return "";
  } catch (const std::exception& e) {
    return dir + ": " + e.what();
  }
}

namespace {

// Nothing half-written or half-removed is listed as a step under `root` (a step being dropped
// by keep_last may still be there, whole).
void expect_listed_steps_verify(const std::string& root, const std::string& what) {
  for (const int64_t step : ckpt::list_steps(root)) {
    const ckpt::VerifyReport report = ckpt::verify(ckpt::step_dir(root, step));
    EXPECT_TRUE(report.ok()) << what << ": step " << step
                             << " is listed but does not verify: " << report.problems.front();
  }
}

// One checkpoint a restart may find: its directory and the scale it was saved with.
struct Saved {
  std::string dir;
  double scale;
};

// What a restart must see in a step root: `latest` names one of `allowed` (the previous latest or
// the new one, the last of them), which verifies and loads exactly; once the save returned (or
// `must_be_new`), the new one. Nothing found is allowed only where nothing was saved before.
void expect_latest(const std::string& root, const std::vector<Saved>& allowed, bool must_be_new,
                   const std::string& what) {
  std::optional<std::string> latest;
  {
    QuietStderr quiet;
    latest = ckpt::latest_checkpoint(root);
  }
  if (!latest) {
    EXPECT_TRUE(allowed.size() == 1 && !must_be_new) << what << ": no checkpoint found";
    return;
  }
  std::string problem = "latest is " + *latest + ", none of the allowed";
  for (size_t i = 0; i < allowed.size(); ++i) {
    if (must_be_new && i + 1 < allowed.size()) continue;
    if (*latest != allowed[i].dir) continue;
    problem = holds(*latest, allowed[i].scale);
    if (problem.empty()) break;
  }
  EXPECT_EQ(problem, "") << what;
  expect_listed_steps_verify(root, what);
}

// The next save (collective) goes through over whatever was left, and becomes `latest`.
void expect_next_save(ProcessGroup& pg, const std::string& root, const std::string& what) {
  const int64_t next = 100;
  pg.barrier();  // every rank has looked at what was there before it changes
  {
    QuietStderr quiet;
    ckpt::save_step(sharded_sample(pg.rank(), pg.size(), 7.0), root, next,
                    ckpt::SaveOptions().keep_last(2));
    ckpt::files::wait_for_background_removal();
  }
  EXPECT_EQ(ckpt::latest_checkpoint(root).value_or("(none)"), ckpt::step_dir(root, next)) << what;
  EXPECT_EQ(holds(ckpt::step_dir(root, next), 7.0), "") << what;
}

// ---- the operations under test ----

std::string root_of(const std::string& top) { return top + "/ckpt"; }

void save_steps(ProcessGroup& pg, const std::string& top, const std::vector<int64_t>& steps,
                int keep_last = 0) {
  for (int64_t s : steps)
    ckpt::save_step(sharded_sample(pg.rank(), pg.size(), static_cast<double>(s)), root_of(top), s,
                    ckpt::SaveOptions().keep_last(keep_last));
  ckpt::files::wait_for_background_removal();
}

// A check of a step root: `latest` among the given (step, scale)s, the last once returned; then
// the next save.
// (Names relative to the root: "step_1", or where latest_checkpoint may point after a save without
// an atomic swap died half way, ".step_1.aside".)
std::function<void(ProcessGroup&, const std::string&, bool, const std::string&)> step_check(
    std::vector<std::pair<std::string, double>> allowed) {
  return [allowed](ProcessGroup& pg, const std::string& top, bool ok, const std::string& what) {
    std::vector<Saved> saved;
    for (const auto& [name, scale] : allowed) saved.push_back({root_of(top) + "/" + name, scale});
    expect_latest(root_of(top), saved, ok, what);
    expect_next_save(pg, root_of(top), what);
  };
}

// A .pt export over an earlier one: the file holds the old export or, once returned, the new one.
void expect_pt(const std::string& file, double old_scale, double new_scale, bool ok,
               const std::string& what) {
  std::string problem;
  try {
    const at::Tensor t = ckpt::load_pt(file).at("sharded").tensor();
    const bool is_new = at::equal(t, expected_sharded(new_scale));
    const bool is_old = at::equal(t, expected_sharded(old_scale));
    if (!(is_new || (is_old && !ok)))
      problem = "holds " + std::string(is_old ? "the old" : "other") + " values";
  } catch (const std::exception& e) {
    problem = e.what();
  }
  EXPECT_EQ(problem, "") << what;
}

// A safetensors export into a new directory: loading it fails (nothing complete is there) or
// gives every tensor exactly; once returned, it loads.
void expect_safetensors(const std::string& dir, const StateDict& reference, bool ok,
                        const std::string& what) {
  StateDict got;
  try {
    got = ckpt::load_safetensors(dir);
  } catch (const std::exception& e) {
    EXPECT_FALSE(ok) << what << ": " << e.what();
    return;
  }
  std::string problem;
  if (got.size() != reference.size()) problem = "holds " + std::to_string(got.size()) + " tensors";
  for (const auto& [key, value] : reference)
    if (!got.contains(key) || !at::equal(got.at(key).tensor(), value.tensor()))
      problem += " " + key + " differs";
  EXPECT_EQ(problem, "") << what;
}

// What the safetensors export of step 2 holds, exported once by a plain export.
const StateDict& safetensors_reference(const std::string& top) {
  static StateDict reference;
  if (reference.size() == 0) {
    TempDir out;
    ckpt::export_safetensors(ckpt::step_dir(root_of(top), 2), out.file("st"));
    reference = ckpt::load_safetensors(out.file("st"));
  }
  return reference;
}

// A FileIO forwarding every call to `to`; with `no_exchange`, a file system without
// RENAME_EXCHANGE (NFS, older kernels), whose swap says EINVAL, so that a save replaces a
// checkpoint by two renames.
struct ForwardingIO : ckpt::FileIO {
  ckpt::FileIO* to = nullptr;
  bool no_exchange = false;
  int open(const std::string& p, int f, int m) override { return to->open(p, f, m); }
  int64_t write(int fd, const void* d, size_t n) override { return to->write(fd, d, n); }
  int64_t pread(int fd, void* d, size_t n, int64_t o) override { return to->pread(fd, d, n, o); }
  int fsync(int fd) override { return to->fsync(fd); }
  int close(int fd) override { return to->close(fd); }
  int64_t file_size(const std::string& p) override { return to->file_size(p); }
  int is_dir(const std::string& p) override { return to->is_dir(p); }
  int mkdir(const std::string& p, int m) override { return to->mkdir(p, m); }
  int rename(const std::string& a, const std::string& b) override { return to->rename(a, b); }
  int exchange(const std::string& a, const std::string& b) override {
    if (!no_exchange) return to->exchange(a, b);
    errno = EINVAL;
    return -1;
  }
  int remove(const std::string& p) override { return to->remove(p); }
  int list_dir(const std::string& p, std::vector<std::string>& n) override {
    return to->list_dir(p, n);
  }
};

// ---- node-local saves on two hosts ----

// Each host's own step root under `top`: rank r of W is on host r * 2 / W (saved as 2 x 2, a
// restart as 2 x 1).
int host_of_rank(const ProcessGroup& pg) { return pg.rank() * 2 / pg.size(); }
std::string host_root(const std::string& top, int host) {
  return top + "/host" + std::to_string(host) + "/ckpt";
}

ckpt::SaveOptions node_local_options(ProcessGroup& pg, int replicas) {
  return ckpt::SaveOptions().group(&pg).node_local(true).keep_last(1).replicas(replicas);
}

// "" if this rank's collective load of `dir` (each rank from its own host's copy) gives exactly
// what the save with `scale` wrote; else what differs or failed.
std::string loads_exactly(ProcessGroup& pg, const std::string& dir, double scale) {
  StateDict sd = sharded_sample(pg.rank(), pg.size(), 0.0);
  try {
    ckpt::load(sd, dir, ckpt::LoadOptions().group(&pg));
  } catch (const std::exception& e) {
    return dir + ": " + e.what();
  }
  return holds_sample(sd, pg.rank(), pg.size(), scale) ? "" : dir + " loads other values";
}

// What the job sees when it restarts after a node-local save_step (`pg`: the restart's ranks):
// agreed_latest_checkpoint names one of `allowed` (relative to the root; the last once the save
// returned), each host's copy of it verifies, and the collective load gives exactly its values;
// no host lists a step that does not verify; the next node-local save goes through and is agreed
// on. Every rank reaches every collective, whatever it found.
void expect_agreed(ProcessGroup& pg, const std::string& top, int replicas,
                   const std::vector<std::pair<std::string, double>>& allowed, bool ok,
                   const std::string& what) {
  const std::string root = host_root(top, host_of_rank(pg));
  std::optional<std::string> agreed;
  std::string problem;
  try {
    QuietStderr quiet;
    agreed = ckpt::agreed_latest_checkpoint(root, pg);
  } catch (const std::exception& e) {
    problem = e.what();
  }
  ASSERT_EQ(problem, "") << what;  // the same on every rank: an all_gather decides
  ASSERT_TRUE(agreed.has_value()) << what << ": the hosts agree on no checkpoint";
  const std::string name = agreed->substr(root.size() + 1);
  double scale = -1;
  for (size_t i = 0; i < allowed.size(); ++i)
    if (name == allowed[i].first && (!ok || i + 1 == allowed.size())) scale = allowed[i].second;
  ASSERT_NE(scale, -1) << what << ": the hosts agree on " << name;
  const ckpt::VerifyReport report = ckpt::verify(*agreed);
  EXPECT_TRUE(report.ok()) << what << ": " << *agreed << ": " << report.problems.front();
  EXPECT_EQ(loads_exactly(pg, *agreed, scale), "") << what;
  expect_listed_steps_verify(root, what);
  pg.barrier();
  {
    QuietStderr quiet;
    ckpt::save_step(sharded_sample(pg.rank(), pg.size(), 7.0), root, 100,
                    node_local_options(pg, replicas));
    ckpt::files::wait_for_background_removal();
  }
  EXPECT_EQ(ckpt::agreed_latest_checkpoint(root, pg).value_or("(none)"), ckpt::step_dir(root, 100))
      << what;
  EXPECT_EQ(loads_exactly(pg, ckpt::step_dir(root, 100), 7.0), "") << what;
}

// save_step(3) over step 2 with keep_last(1), node-local, as 2 hosts x 2 ranks, with `replicas`
// copies of each data file: the old step is removed on a host only once every host holds the new.
Operation node_local_save_step(const char* name, int replicas) {
  Operation op{
      name, 4,
      [replicas](ProcessGroup& pg, const std::string& top) {
        for (int64_t s : {1, 2})
          ckpt::save_step(sharded_sample(pg.rank(), pg.size(), static_cast<double>(s)),
                          host_root(top, host_of_rank(pg)), s, node_local_options(pg, replicas));
        ckpt::files::wait_for_background_removal();
      },
      [replicas](ProcessGroup& pg, const std::string& top, ckpt::FileIO& io) {
        ckpt::save_step(sharded_sample(pg.rank(), pg.size(), 3.0), host_root(top, host_of_rank(pg)),
                        3, ckpt::SaveOptions(node_local_options(pg, replicas)).io(&io));
      },
      [replicas](ProcessGroup& pg, const std::string& top, bool ok, const std::string& what) {
        expect_agreed(pg, top, replicas, {{"step_2", 2.0}, {"step_3", 3.0}}, ok, what);
      }};
  op.restart_world = 2;
  op.host_of = [](int rank) { return rank / 2; };
  // About 4,000 distinct states, 30-80 ms each: every one takes 2-6 minutes (recorded in
  // docs/reliability.md); the suite checks each kind's first and every 8th.
  op.stride = 8;
  return op;
}

std::vector<Operation> operations() {
  std::vector<Operation> ops;
  ops.push_back({"save_step with keep_last", 2,
                 [](ProcessGroup& pg, const std::string& top) {
                   save_steps(pg, top, {1, 2}, 2);
                 },
                 [](ProcessGroup& pg, const std::string& top, ckpt::FileIO& io) {
                   ckpt::save_step(sharded_sample(pg.rank(), 2, 3.0), root_of(top), 3,
                                   ckpt::SaveOptions().keep_last(2).io(&io));
                 },
                 step_check({{"step_2", 2.0}, {"step_3", 3.0}})});
  ops.push_back({"save replacing a checkpoint", 2,
                 [](ProcessGroup& pg, const std::string& top) { save_steps(pg, top, {1}); },
                 [](ProcessGroup& pg, const std::string& top, ckpt::FileIO& io) {
                   ckpt::save_step(sharded_sample(pg.rank(), 2, 2.0), root_of(top), 1,
                                   ckpt::SaveOptions().io(&io));
                 },
                 step_check({{"step_1", 1.0}, {"step_1", 2.0}})});
  ops.push_back({"save replacing a checkpoint without RENAME_EXCHANGE", 2,
                 [](ProcessGroup& pg, const std::string& top) { save_steps(pg, top, {1}); },
                 [](ProcessGroup& pg, const std::string& top, ckpt::FileIO& io) {
                   ForwardingIO no_exchange;
                   no_exchange.to = &io;
                   no_exchange.no_exchange = true;
                   ckpt::save_step(sharded_sample(pg.rank(), 2, 2.0), root_of(top), 1,
                                   ckpt::SaveOptions().io(&no_exchange));
                 },
                 step_check({{"step_1", 1.0}, {".step_1.aside", 1.0}, {"step_1", 2.0}})});
  ops.push_back({"first save into a new directory", 2, [](ProcessGroup&, const std::string&) {},
                 [](ProcessGroup& pg, const std::string& top, ckpt::FileIO& io) {
                   ckpt::save_step(sharded_sample(pg.rank(), 2, 1.0), root_of(top), 1,
                                   ckpt::SaveOptions().io(&io));
                 },
                 step_check({{"step_1", 1.0}})});
  ops.push_back({"async save_step", 2,
                 [](ProcessGroup& pg, const std::string& top) { save_steps(pg, top, {1}); },
                 [](ProcessGroup& pg, const std::string& top, ckpt::FileIO& io) {
                   // One saver per rank process for every point (making its group is a collective
                   // of its own), never destroyed: ranks leave by _exit.
                   static ForwardingIO forward;
                   static auto* saver =
                       new ckpt::AsyncSaver(ckpt::SaveOptions().keep_last(1).io(&forward));
                   forward.to = &io;
                   saver->save_step(sharded_sample(pg.rank(), 2, 2.0), root_of(top), 2);
                   saver->wait();
                 },
                 step_check({{"step_1", 1.0}, {"step_2", 2.0}})});
  ops.push_back({"export_pt over an earlier export", 1,
                 [](ProcessGroup& pg, const std::string& top) {
                   save_steps(pg, top, {1, 2});
                   ckpt::export_pt(ckpt::step_dir(root_of(top), 1), top + "/out/model.pt");
                 },
                 [](ProcessGroup&, const std::string& top, ckpt::FileIO& io) {
                   ckpt::export_pt(ckpt::step_dir(root_of(top), 2), top + "/out/model.pt",
                                   ckpt::ExportOptions().io(&io));
                 },
                 [](ProcessGroup&, const std::string& top, bool ok, const std::string& what) {
                   expect_pt(top + "/out/model.pt", 1.0, 2.0, ok, what);
                 }});
  // Three safetensors files and an index, into a directory that does not exist yet.
  ops.push_back({"export_safetensors in shards", 1,
                 [](ProcessGroup& pg, const std::string& top) { save_steps(pg, top, {2}); },
                 [](ProcessGroup&, const std::string& top, ckpt::FileIO& io) {
                   ckpt::export_safetensors(ckpt::step_dir(root_of(top), 2), top + "/hf/out",
                                            ckpt::ExportOptions().max_shard_bytes(64).io(&io));
                 },
                 [](ProcessGroup&, const std::string& top, bool ok, const std::string& what) {
                   expect_safetensors(top + "/hf/out", safetensors_reference(top), ok, what);
                 }});
  ops.push_back(node_local_save_step("node-local save_step", 1));
  ops.push_back(node_local_save_step("node-local save_step with copies on the other host", 2));
  return ops;
}

}  // namespace

const Operation& operation(const std::string& name) {
  static const std::vector<Operation> all = operations();
  for (const Operation& op : all)
    if (name == op.name) return op;
  throw std::runtime_error("no operation " + name);
}

std::string scratch_base() {
  if (::access("/dev/shm", W_OK | X_OK) == 0) return "/dev/shm";
  const char* base = std::getenv("TMPDIR");
  return base && *base ? base : "/tmp";
}

}  // namespace testing
}  // namespace fsdp
