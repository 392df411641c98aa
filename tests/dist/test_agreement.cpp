// dist/agreement.h: verdicts keep their kind, errno and message through the one encoding; an
// exchange ends with every rank going on or every rank throwing, the failed rank its own error
// and the others the lowest failing rank's kind.
#include "dist/agreement.h"

#include <gtest/gtest.h>

#include <cerrno>
#include <stdexcept>
#include <string>
#include <vector>

#include <c10/util/Exception.h>

#include "fsdp/dist.h"
#include "fsdp/errors.h"
#include "multi_rank.h"

using fsdp::dist::Verdict;
using fsdp::dist::Verdicts;
using fsdp::testing::run_ranks;

namespace {

// The kind a verdict throws, as a name, and its message and errno.
struct Thrown {
  std::string kind, message;
  int error_code = 0;
};

Thrown thrown_by(const std::function<void()>& f) {
  try {
    f();
  } catch (const fsdp::IOError& e) {
    return {"IOError", e.what(), e.error_code()};
  } catch (const fsdp::CorruptionError& e) {  // before ValueError: it is one
    return {"CorruptionError", e.what()};
  } catch (const fsdp::ValueError& e) {
    return {"ValueError", e.what()};
  } catch (const fsdp::DistError& e) {
    return {"DistError", e.what()};
  } catch (const fsdp::StateError& e) {
    return {"StateError", e.what()};
  } catch (const fsdp::InternalError& e) {
    return {"InternalError", e.what()};
  } catch (const std::exception& e) {
    return {"other", e.what()};
  }
  return {"nothing", ""};
}

// A user's own ValueError: the rank that raised it must get it back as it was, not as its base.
struct KeyMissing : fsdp::ValueError {
  using fsdp::ValueError::ValueError;
};

Verdict failing(const std::exception& e) { return Verdict::failed(e); }

}  // namespace

TEST(Agreement, EveryKindCrossesTheEncodingWithItsErrnoAndMessage) {
  struct Case {
    Verdict verdict;
    std::string kind;
    int error_code;
  };
  const std::vector<Case> cases = {
      {failing(fsdp::ValueError("bad 'fc.weight'")), "ValueError", 0},
      {failing(fsdp::CorruptionError("bad 'fc.weight'")), "CorruptionError", 0},
      {failing(fsdp::IOError("bad 'fc.weight'", ENOSPC)), "IOError", ENOSPC},
      {failing(fsdp::DistError("bad 'fc.weight'")), "DistError", 0},
      {failing(fsdp::StateError("bad 'fc.weight'")), "StateError", 0},
      {failing(fsdp::InternalError("bad 'fc.weight'")), "InternalError", 0},
      // Not one of ours (the standard library's, LibTorch's): an InternalError elsewhere.
      {failing(std::runtime_error("bad 'fc.weight'")), "InternalError", 0},
  };
  for (const Case& c : cases) {
    const Verdict back = Verdict::decode(c.verdict.encode());
    ASSERT_FALSE(back.ok()) << c.kind;
    EXPECT_EQ(back.message(), "bad 'fc.weight'") << c.kind;
    const Thrown t = thrown_by([&] { back.raise("on rank 2: " + back.message()); });
    EXPECT_EQ(t.kind, c.kind);
    EXPECT_EQ(t.message, "on rank 2: bad 'fc.weight'");
    EXPECT_EQ(t.error_code, c.error_code) << c.kind;
  }
  // A message that looks like an encoding, and a payload of any bytes, cross unchanged.
  const std::string bytes("EI28;K\0\n\xff", 9);
  EXPECT_EQ(Verdict::decode(Verdict(bytes).encode()).payload(), bytes);
  EXPECT_TRUE(Verdict::decode(Verdict(bytes).encode()).ok());
  // (a message is what() of an exception: a C string, so without its NUL)
  EXPECT_EQ(Verdict::decode(failing(fsdp::ValueError("EI28;K\n\xff")).encode()).message(),
            "EI28;K\n\xff");
  // The negative control: another kind's letter reads as that kind.
  std::string encoded = failing(fsdp::ValueError("x")).encode();
  encoded[1] = 'S';
  EXPECT_EQ(thrown_by([&] { Verdict::decode(encoded).rethrow_own(); }).kind, "StateError");
}

TEST(Agreement, BytesThatAreNoVerdictAreAnInternalFailure) {
  for (const std::string bad : {"", "X", "E", "EZoops", "EI28 no semicolon"}) {
    const Verdict v = Verdict::decode(bad);
    EXPECT_FALSE(v.ok()) << bad;
    EXPECT_EQ(thrown_by([&] { v.rethrow_own(); }).kind, "InternalError") << bad;
  }
}

TEST(Agreement, TheRankThatFailedRethrowsItsOwnException) {
  const Verdict mine = Verdict::of([]() -> std::string { throw KeyMissing("no 'fc.bias'"); });
  ASSERT_FALSE(mine.ok());
  EXPECT_THROW(mine.rethrow_own(), KeyMissing);
  // What crossed the wire keeps the kind, not the user's type.
  const Verdict elsewhere = Verdict::decode(mine.encode());
  EXPECT_THROW(elsewhere.rethrow_own(), fsdp::ValueError);
  try {
    elsewhere.rethrow_own();
  } catch (const KeyMissing&) {
    ADD_FAILURE() << "another rank cannot have the thrower's own type";
  } catch (const fsdp::ValueError&) {
  }
  EXPECT_EQ(Verdict::of([] { return std::string("payload"); }).payload(), "payload");
}

TEST(Agreement, FailuresNameEveryFailedRank) {
  const Verdicts all(
      {Verdict("a"), failing(fsdp::ValueError("x")), Verdict(), failing(fsdp::IOError("y", EIO))});
  EXPECT_FALSE(all.ok());
  EXPECT_EQ(all.first_failed(), 1);
  EXPECT_EQ(all.failures(), "rank 1: x; rank 3: y");
  const Thrown t = thrown_by(
      [&] { all.throw_first([](int r, const std::string& m) { return m + std::to_string(r); }); });
  EXPECT_EQ(t.kind, "ValueError");
  EXPECT_EQ(t.message, "x1");
  const Verdicts one({failing(fsdp::ValueError("x"))});
  EXPECT_EQ(one.failures(false), "x");
  EXPECT_EQ(one.failures(), "rank 0: x");
  const Verdicts fine({Verdict("a"), Verdict("b")});
  EXPECT_NO_THROW(fine.throw_first([](int, const std::string&) { return std::string(); }));
  EXPECT_EQ(fine.payloads(), (std::vector<std::string>{"a", "b"}));
}

// Three ranks: rank 1 fails with a full disk, rank 2 with a user's ValueError. Rank 1 and 2 throw
// their own; rank 0 throws rank 1's kind and errno, naming it. Then an exchange every rank passes
// returns every rank's payload, and rank 2's broadcast verdict reaches every rank.
TEST(Agreement, EveryRankThrowsOrEveryRankGoesOn) {
  run_ranks(3, [](fsdp::dist::ProcessGroup& pg) {
    const int me = pg.rank();
    const Verdict mine = Verdict::of([&] {
      if (me == 1) throw fsdp::IOError("disk full", ENOSPC);
      if (me == 2) throw KeyMissing("no 'fc.bias'");
      return std::string("fine");
    });
    const Thrown t = thrown_by([&] {
      fsdp::dist::agree(&pg, mine, [](int r, const std::string& m) {
        return "rank " + std::to_string(r) + " failed: " + m;
      });
    });
    if (me == 0) {
      EXPECT_EQ(t.kind, "IOError");
      EXPECT_EQ(t.error_code, ENOSPC);
      EXPECT_EQ(t.message, "rank 1 failed: disk full");
    } else if (me == 1) {
      EXPECT_EQ(t.kind, "IOError");
      EXPECT_EQ(t.message, "disk full");
    } else {
      EXPECT_THROW(mine.rethrow_own(), KeyMissing);
      EXPECT_EQ(t.message, "no 'fc.bias'");
    }
    const std::vector<std::string> all = fsdp::dist::agree(
        &pg, Verdict(std::string(static_cast<size_t>(me) * 200, 'a' + static_cast<char>(me))),
        [](int, const std::string& m) { return m; });
    ASSERT_EQ(all.size(), 3u);
    for (int r = 0; r < 3; ++r)
      EXPECT_EQ(all[static_cast<size_t>(r)],
                std::string(static_cast<size_t>(r) * 200, 'a' + static_cast<char>(r)));
    const Verdict from2 = fsdp::dist::broadcast_verdict(
        &pg, me == 2 ? failing(fsdp::CorruptionError("torn .metadata")) : Verdict(), 2);
    EXPECT_EQ(thrown_by([&] { from2.rethrow_own(); }).kind, "CorruptionError");
    EXPECT_EQ(fsdp::dist::broadcast_verdict(&pg, Verdict(me == 0 ? "meta" : ""), 0).payload(),
              "meta");
  });
}

TEST(Agreement, WithoutAGroupOnlyThisRanksVerdictCounts) {
  EXPECT_EQ(fsdp::dist::agree(nullptr, Verdict("x"), {}), std::vector<std::string>{"x"});
  EXPECT_THROW(fsdp::dist::agree(nullptr, failing(fsdp::StateError("s")), {}), fsdp::StateError);
  EXPECT_EQ(fsdp::dist::broadcast_verdict(nullptr, Verdict("y"), 0).payload(), "y");
}
