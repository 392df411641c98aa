// Judging heartbeats (src/launch/heartbeats.h) on a synthetic clock: a node that beats is never
// given up, and a node that stops is given up within lost_after of its last beat, whatever the
// phase of its beats against the watcher's looks.
#include <gtest/gtest.h>

#include <chrono>

#include "launch/heartbeats.h"

namespace {

using fsdp_run::HeartbeatWatch;
using Clock = HeartbeatWatch::Clock;

std::chrono::milliseconds ms(double s) {
  return std::chrono::milliseconds(static_cast<int64_t>(s * 1000));
}

// A node beating every `interval` s stops after its beat at `stop_at` s; the watcher looks every
// look_period. Returns the time of the first look that gives it up (seconds), or -1.
double given_up_at(double lost_after, double interval, double phase, double stop_at, double until) {
  const double look = HeartbeatWatch::look_period(lost_after);
  HeartbeatWatch w(lost_after, look);
  const Clock::time_point t0{};
  for (double t = 0; t < until; t += look) {
    // Beats at phase, phase + interval, ... up to stop_at.
    int64_t beats = 0;
    for (double b = phase; b <= t && b <= stop_at; b += interval) ++beats;
    if (w.lost(w.see(1, beats, t0 + ms(t)))) return t;
  }
  return -1;
}

TEST(Heartbeats, ALiveNodeIsNeverGivenUp) {
  for (double phase : {0.0, 0.3, 2.7, 4.9})
    EXPECT_EQ(given_up_at(15, 5, phase, 1e9, 120), -1) << phase;
  for (double phase : {0.0, 0.33, 0.6})  // --heartbeat-timeout 2: a beat every 2/3 s
    EXPECT_EQ(given_up_at(2, 2.0 / 3, phase, 1e9, 60), -1) << phase;
}

TEST(Heartbeats, ASilentNodeIsGivenUpWithinLostAfterOfItsLastBeat) {
  for (double phase : {0.0, 0.1, 1.3, 2.5, 3.9, 4.95}) {
    for (double stop : {20.0, 21.0, 23.5}) {
      double last = phase;
      while (last + 5 <= stop) last += 5;
      const double at = given_up_at(15, 5, phase, stop, 120);
      ASSERT_GE(at, 0) << phase;
      EXPECT_LE(at - last, 15.0 + 1e-9) << "phase " << phase << " stop " << stop;
      EXPECT_GE(at - last, 13.0 - 1e-9) << "given up too early: phase " << phase;
    }
  }
}

TEST(Heartbeats, ForgottenNodesStartAfresh) {
  HeartbeatWatch w(2, HeartbeatWatch::look_period(2));
  const Clock::time_point t0{};
  EXPECT_EQ(w.see(1, 5, t0), 0);
  EXPECT_TRUE(w.lost(w.see(1, 5, t0 + ms(1.8))));
  w.forget(1);
  EXPECT_EQ(w.see(1, 5, t0 + ms(1.9)), 0);
  EXPECT_FALSE(w.lost(w.see(1, 5, t0 + ms(2.5))));
}

}  // namespace
