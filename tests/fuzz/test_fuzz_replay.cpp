// Replays the fuzz targets' seeds and kept regression inputs (tests/fuzz/, issue 39) in the normal
// suite, built with the normal compiler: an input that once crashed a reader, hung it or made it
// throw the wrong type fails here, on every build, without clang or libFuzzer.
//
// Each input runs in a forked child, so that a crash names its file instead of ending the suite,
// and under an alarm, so that a hang is a failure too.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <csignal>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

// Built with AddressSanitizer (scripts/sanitize.sh), a child checks for leaks before it leaves:
// _Exit skips LeakSanitizer's own check at exit.
#if defined(__SANITIZE_ADDRESS__)
#define FSDP_REPLAY_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FSDP_REPLAY_ASAN 1
#endif
#endif
#ifdef FSDP_REPLAY_ASAN
#include <sanitizer/lsan_interface.h>
#endif

#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/checkpoint/export.h"
#include "fsdp/state_value.h"
#include "fuzz/targets.h"
#include "multi_rank.h"

namespace {

namespace fs = std::filesystem;

const fs::path kFuzzDir = fs::path(FSDP_TEST_SOURCE_DIR) / "fuzz";

std::vector<fs::path> inputs_of(const fs::path& dir) {
  std::vector<fs::path> out;
  if (!fs::is_directory(dir)) return out;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.is_regular_file() && e.path().filename().string()[0] != '.') out.push_back(e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// How one input fared in a child process.
enum class Outcome { ACCEPTED, REFUSED, BROKE };

struct Result {
  Outcome outcome = Outcome::BROKE;
  std::string problem;  // for BROKE: what went wrong
};

constexpr int kExitAccepted = 0, kExitRefused = 5, kExitForeign = 3, kExitLeaked = 6;

[[noreturn]] void leave(int code) {
#ifdef FSDP_REPLAY_ASAN
  if (__lsan_do_recoverable_leak_check() != 0) std::_Exit(kExitLeaked);
#endif
  std::_Exit(code);
}

// Runs fn(data, size) in a child under a `seconds` alarm.
Result run_isolated(fsdp::fuzz::TargetFn fn, const std::string& bytes, unsigned seconds) {
  const pid_t pid = ::fork();
  if (pid < 0) return {Outcome::BROKE, "fork failed"};
  if (pid == 0) {
    ::alarm(seconds);
    try {
      const bool ok = fn(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
      leave(ok ? kExitAccepted : kExitRefused);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "escaped exception: %s\n", e.what());
      std::_Exit(kExitForeign);
    } catch (...) {
      std::_Exit(kExitForeign);
    }
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (WIFEXITED(status) && WEXITSTATUS(status) == kExitAccepted) return {Outcome::ACCEPTED, ""};
  if (WIFEXITED(status) && WEXITSTATUS(status) == kExitRefused) return {Outcome::REFUSED, ""};
  if (WIFSIGNALED(status)) {
    return {Outcome::BROKE, WTERMSIG(status) == SIGALRM
                                ? "took over " + std::to_string(seconds) + " s"
                                : "killed by signal " + std::to_string(WTERMSIG(status))};
  }
  const int code = WEXITSTATUS(status);
  return {Outcome::BROKE, code == kExitForeign  ? "an exception other than fsdp::Error escaped"
                          : code == kExitLeaked ? "it leaked memory (LeakSanitizer's report above)"
                                                : "exit status " + std::to_string(code)};
}

// Generous: the fuzzers' own limit is 1 s, but this machine may be running the rest of the suite.
constexpr unsigned kSecondsPerInput = 20;

// Seeds are real files (ours and Python's): each must be read all the way through, or the
// fuzzer would start its search from an error path.
TEST(FuzzReplay, EverySeedIsAcceptedWhole) {
  int replayed = 0;
  for (const auto& target : fsdp::fuzz::targets()) {
    const auto seeds = inputs_of(kFuzzDir / "corpus" / target.name);
    EXPECT_FALSE(seeds.empty()) << "no seed for fuzz target " << target.name << " in "
                                << (kFuzzDir / "corpus" / target.name);
    for (const auto& input : seeds) {
      const Result r = run_isolated(target.run, read_all(input), kSecondsPerInput);
      EXPECT_EQ(r.problem, "") << "fuzz target " << target.name << " on " << input;
      EXPECT_EQ(r.outcome, Outcome::ACCEPTED)
          << "fuzz target " << target.name << " refuses its seed " << input
          << " (FSDP_FUZZ_VERBOSE=1 says why)";
      ++replayed;
    }
  }
  std::printf("replayed %d seeds through %zu targets\n", replayed, fsdp::fuzz::targets().size());
}

// Inputs that once crashed, hung or misled a reader (each named after what it found): read
// safely now, whether accepted or refused.
TEST(FuzzReplay, EveryKeptFindingIsReadSafely) {
  int replayed = 0;
  for (const auto& target : fsdp::fuzz::targets()) {
    for (const auto& input : inputs_of(kFuzzDir / "regressions" / target.name)) {
      const Result r = run_isolated(target.run, read_all(input), kSecondsPerInput);
      EXPECT_NE(r.outcome, Outcome::BROKE)
          << "fuzz target " << target.name << " on " << input << ": " << r.problem;
      ++replayed;
    }
  }
  std::printf("replayed %d kept findings\n", replayed);
}

// The harness can fail: a target that crashes, hangs or lets a foreign exception out is reported,
// and a refusal is told apart from an acceptance.
bool crashes(const uint8_t*, size_t) { std::abort(); }
bool hangs(const uint8_t*, size_t) {
  for (;;) ::pause();
}
bool throws_foreign(const uint8_t*, size_t) { throw std::logic_error("not an fsdp::Error"); }
bool refuses(const uint8_t*, size_t) { return false; }
bool accepts(const uint8_t*, size_t) { return true; }

TEST(FuzzReplay, HarnessReportsCrashesHangsAndForeignExceptions) {
  EXPECT_EQ(run_isolated(crashes, "x", 5).problem, "killed by signal " + std::to_string(SIGABRT));
  EXPECT_EQ(run_isolated(hangs, "x", 1).problem, "took over 1 s");
  EXPECT_EQ(run_isolated(throws_foreign, "x", 5).problem,
            "an exception other than fsdp::Error escaped");
  EXPECT_EQ(run_isolated(refuses, "x", 5).outcome, Outcome::REFUSED);
  EXPECT_EQ(run_isolated(accepts, "x", 5).outcome, Outcome::ACCEPTED);
  // A real reader refuses a damaged seed instead of accepting it.
  const auto* pickle = fsdp::fuzz::find_target("pickle");
  ASSERT_NE(pickle, nullptr);
  EXPECT_EQ(run_isolated(pickle->run, "\x80\x02}q\x00", 5).outcome, Outcome::REFUSED);
  EXPECT_EQ(run_isolated(pickle->run, std::string("\x80\x02}q\x00.", 6), 5).outcome,
            Outcome::ACCEPTED);
  EXPECT_EQ(fsdp::fuzz::find_target("no such target"), nullptr);
}

// The directory targets refuse a seed that lost one of its files: their acceptance of the seeds
// above is the readers' doing, not a target that accepts anything.
std::string without_file(const std::string& input, const std::string& path) {
  const std::string sep = fsdp::fuzz::kFileSeparator;
  std::string out;
  size_t at = 0, dropped = 0;
  while (at <= input.size()) {
    const size_t end = std::min(input.find(sep, at), input.size());
    const std::string part = input.substr(at, end - at);
    if (part.compare(0, path.size() + 1, path + "\n") == 0) {
      ++dropped;
    } else {
      out += (out.empty() ? "" : sep) + part;
    }
    at = end + sep.size();
  }
  EXPECT_EQ(dropped, 1u) << path;
  return out;
}

TEST(FuzzReplay, DirectoryTargetsRefuseASeedWithoutOneOfItsFiles) {
  const std::vector<std::array<std::string, 3>> cases = {
      {"checkpoint_files", "ours_dcp_w2", "ckpt/__1_0.distcp"},
      {"safetensors_files", "ours_st_sharded", "st/model-00002-of-00002.safetensors"},
      {"assemble", "ours_nl", "host1/__1_0.distcp"},
      {"fsdp_ckpt", "ours_dcp", "a/__0_0.distcp"},
  };
  for (const auto& [target, seed, path] : cases) {
    const auto* t = fsdp::fuzz::find_target(target);
    ASSERT_NE(t, nullptr) << target;
    const std::string whole = read_all(kFuzzDir / "corpus" / target / seed);
    EXPECT_EQ(run_isolated(t->run, whole, kSecondsPerInput).outcome, Outcome::ACCEPTED) << seed;
    EXPECT_EQ(run_isolated(t->run, without_file(whole, path), kSecondsPerInput).outcome,
              Outcome::REFUSED)
        << target << " accepted " << seed << " without " << path;
  }
}

// Not a test: writes the files of ours that seed the corpora (tests/fuzz/make_seeds.py explains
// the whole procedure). Run with --gtest_also_run_disabled_tests and FSDP_FUZZ_SEEDS_OUT=DIR.
TEST(FuzzSeeds, DISABLED_WriteOurFiles) {
  const char* out = std::getenv("FSDP_FUZZ_SEEDS_OUT");
  ASSERT_NE(out, nullptr) << "set FSDP_FUZZ_SEEDS_OUT";
  namespace ckpt = fsdp::checkpoint;
  const at::Tensor full = at::arange(12, at::kFloat).reshape({4, 3});
  fsdp::StateDict model;
  model.insert_or_assign(
      "w", fsdp::ShardedTensor({4, 3}, at::kFloat,
                               {fsdp::Shard{full.narrow(0, 0, 4).clone(),
                                            fsdp::ShardMetadata{{0, 0}, {4, 3}, 0}}}));
  model.insert_or_assign("b", at::tensor({0.5, -1.0}).to(at::kBFloat16));
  model.insert_or_assign("steps", at::tensor({7}, at::kLong));
  model.insert_or_assign("scale", at::scalar_tensor(2.5, at::kDouble));
  model.insert_or_assign("empty", at::zeros({0, 2}));
  fsdp::StateDict sd;
  sd.insert_or_assign("model", model);
  sd.insert_or_assign("step", fsdp::StateValue(int64_t{3}));
  ckpt::save(sd, std::string(out) + "/ours_dcp");
  fsdp::StateDict plain;
  plain.insert_or_assign("w", full);
  plain.insert_or_assign("b", at::tensor({0.5, -1.0}).to(at::kBFloat16));
  plain.insert_or_assign("scale", at::scalar_tensor(2.5, at::kDouble));
  ckpt::save_pt(plain, std::string(out) + "/ours.pt", ckpt::ExportOptions().prefix(""));
  ckpt::save_safetensors(plain, std::string(out) + "/ours_st", ckpt::ExportOptions().prefix(""));
  // Sharded: three files and model.safetensors.index.json (the safetensors_files target).
  ckpt::save_safetensors(plain, std::string(out) + "/ours_st_sharded",
                         ckpt::ExportOptions().prefix("").max_shard_bytes(16));
  // Two ranks: a checkpoint with two data files (checkpoint_files), and a node-local save whose
  // two hosts each hold one (assemble).
  const auto results = fsdp::testing::run_ranks(2, [&](fsdp::dist::ProcessGroup& pg) {
    fsdp::StateDict m;
    m.insert_or_assign("w", fsdp::chunk_sharded(full, pg.rank(), 2));
    m.insert_or_assign("b", at::tensor({0.5, -1.0}).to(at::kBFloat16));
    fsdp::StateDict two;
    two.insert_or_assign("model", m);
    two.insert_or_assign("step", fsdp::StateValue(int64_t{3}));
    ckpt::save(two, std::string(out) + "/ours_dcp_w2", ckpt::SaveOptions().group(&pg));
    ckpt::save(two, std::string(out) + "/ours_nl/host" + std::to_string(pg.rank()),
               ckpt::SaveOptions().group(&pg).node_local(true));
  });
  for (const auto& r : results) ASSERT_TRUE(r.ok) << "rank " << r.rank << ": " << r.message;
}

}  // namespace
