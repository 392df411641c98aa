// Step directories (fsdp/checkpoint/checkpoint.h): `<root>/step_<N>` saved by save_step, the
// `latest` pointer, keep_last's removals, and finding the checkpoint to resume from, alone
// (latest_checkpoint) or agreed across a group (agreed_latest_checkpoint).
#include <c10/util/Exception.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <iterator>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "checkpoint/save/protocol.h"
#include "checkpoint/save/save_run.h"
#include "checkpoint/storage/files.h"
#include "dist/agreement.h"
#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/errors.h"
#include "util/message.h"

namespace fsdp {
namespace checkpoint {
namespace {

bool parse_step(const std::string& name, int64_t& step) {
  if (name.size() <= 5 || name.compare(0, 5, "step_") != 0 || name.size() > 5 + 18) return false;
  step = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return false;
    step = step * 10 + (name[i] - '0');
  }
  return std::to_string(step) == name.substr(5);  // no leading zeros: one name per step
}

}  // namespace

std::string step_dir(const std::string& root, int64_t step) {
  return files::join(files::normalize(root), "step_" + std::to_string(step));
}

std::vector<int64_t> list_steps(const std::string& root, FileIO* io_in) {
  FileIO& io = io_in ? *io_in : default_file_io();
  std::vector<std::string> names;
  std::vector<int64_t> steps;
  if (io.is_dir(root) != 1) return steps;
  if (io.list_dir(root, names) != 0) {
    const int err = errno;  // before the message allocates
    files::io_error("checkpoint", "listing", root, err);
  }
  for (const auto& n : names) {
    int64_t s = 0;
    if (parse_step(n, s) && io.file_size(files::join(files::join(root, n), ".metadata")) >= 0)
      steps.push_back(s);
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

std::string save_step(const StateDict& state_dict, const std::string& root_in, int64_t step,
                      const SaveOptions& options) {
  if (step < 0) throw ValueError(detail::msg("checkpoint save_step: step ", step, " < 0"));
  FileIO& io = options.io() ? *options.io() : default_file_io();
  const std::string root = files::normalize(root_in);
  const std::string dir = step_dir(root, step);
  auto clean_stale = [&] {
    std::vector<std::string> names;
    if (io.is_dir(root) != 1 || io.list_dir(root, names) != 0) return;
    for (const auto& n : names) {
      int64_t s = 0;
      // ".step_N.partial": a save that died; ".step_N.partial.old": a replaced or dropped step
      // whose removal did not finish; ".step_N.aside": step N, if a save replacing it without
      // an atomic swap died half way (restored, or removed if the new one made it).
      for (const std::string suffix : {".partial", ".partial.old", ".aside"}) {
        if (n.size() > 1 + suffix.size() && n[0] == '.' &&
            n.compare(n.size() - suffix.size(), suffix.size(), suffix) == 0 &&
            parse_step(n.substr(1, n.size() - 1 - suffix.size()), s)) {
          if (suffix == ".aside")
            protocol::restore_aside(io, step_dir(root, s));
          else
            files::remove_tree(io, files::join(root, n), save_run::kWhat);
          break;
        }
      }
    }
  };
  auto point_latest = [&] {
    const std::string tmp = files::join(root, ".latest.tmp");
    files::write_file(io, tmp, "step_" + std::to_string(step) + "\n", save_run::kWhat);
    if (io.rename(tmp, files::join(root, "latest")) != 0) {
      const int err = errno;  // before the message allocates
      files::io_error(save_run::kWhat, "renaming", tmp, err);
    }
    files::sync_dir(io, root, save_run::kWhat);
    if (options.keep_last() <= 0) return;
    std::vector<int64_t> steps = list_steps(root, &io);
    const auto keep = static_cast<size_t>(options.keep_last());
    // Dropped steps are renamed out of sight at once and unlinked in the background.
    std::vector<std::string> dropped;
    for (size_t i = 0; i + keep < steps.size(); ++i) {
      if (steps[i] == step) continue;
      const std::string old = step_dir(root, steps[i]);
      const std::string hidden =
          files::join(root, ".step_" + std::to_string(steps[i]) + ".partial.old");
      files::wait_for_background_removal();  // it may be removing `hidden` from an earlier save
      if (io.rename(old, hidden) == 0) {
        dropped.push_back(hidden);
      } else {
        TORCH_WARN("fsdp checkpoint: keep_last could not remove ", old, ": ", std::strerror(errno));
      }
    }
    if (dropped.empty()) return;
    // The renames reach the disk before any unlink inside them: else a power cut could keep an
    // unlink and lose the rename, and a half-removed step would be listed again (crash points,
    // tests/faults/test_crash_points.cpp).
    files::sync_dir(io, root, save_run::kWhat);
    files::remove_tree_in_background(io, dropped, save_run::kWhat);
  };
  protocol::save_impl(state_dict, dir, options, clean_stale, point_latest);
  return dir;
}

std::optional<std::string> latest_checkpoint(const std::string& root_in, FileIO* io_in) {
  FileIO& io = io_in ? *io_in : default_file_io();
  const std::string root = files::normalize(root_in);
  const std::string pointer = files::join(root, "latest");
  if (io.file_size(pointer) >= 0) {
    std::string name = files::read_file(io, pointer, 4096, "checkpoint latest");
    while (!name.empty() && (name.back() == '\n' || name.back() == '\r')) name.pop_back();
    int64_t s = 0;
    if (parse_step(name, s)) {
      const std::string dir = files::join(root, name);
      if (io.file_size(files::join(dir, ".metadata")) >= 0) return dir;
      // A save replacing this step without an atomic swap died between its two renames.
      if (io.file_size(files::join(protocol::aside_of(dir), ".metadata")) >= 0)
        return protocol::aside_of(dir);
    }
    TORCH_WARN("fsdp checkpoint: ", pointer, " names '", name,
               "', which is not a committed checkpoint; taking the newest step instead");
  }
  const std::vector<int64_t> steps = list_steps(root, &io);
  if (steps.empty()) return std::nullopt;
  return step_dir(root, steps.back());
}

std::optional<std::string> agreed_latest_checkpoint(const std::string& root_in,
                                                    dist::ProcessGroup& group, FileIO* io_in) {
  FileIO& io = io_in ? *io_in : default_file_io();
  const std::string root = files::normalize(root_in);
  // Each rank's answer alone, by its name under the root ("step_3"; the roots may differ, as
  // node-local disks mounted at other paths or a new host's empty disk do), and its committed
  // steps: "<name>\n<step> <step> ...", or its error, which fails every rank (dist/agreement.h).
  const dist::Verdict mine = dist::Verdict::of([&] {
    const std::optional<std::string> latest = latest_checkpoint(root, &io);
    std::string out = (latest ? latest->substr(latest->rfind('/') + 1) : std::string()) + "\n";
    for (int64_t s : list_steps(root, &io)) out += std::to_string(s) + " ";
    return out;
  });
  std::optional<std::string> agreed;  // the latest of every rank that has one, if they agree
  bool differ = false;
  std::optional<std::set<int64_t>> common;  // the steps every rank with any step lists
  const std::vector<std::string> all = dist::agree(&group, mine, [](int r, const std::string& e) {
    return detail::msg("checkpoint latest: ", detail::rank(r), ": ", e);
  });
  for (size_t r = 0; r < all.size(); ++r) {
    const size_t nl = all[r].find('\n');
    const std::string latest = all[r].substr(0, nl);
    if (!latest.empty()) {
      differ = differ || (agreed && *agreed != latest);
      agreed = latest;
    }
    std::set<int64_t> steps;
    std::istringstream in(all[r].substr(nl + 1));
    for (int64_t s = 0; in >> s;) steps.insert(s);
    if (steps.empty()) continue;
    if (common) {
      std::set<int64_t> both;
      std::set_intersection(common->begin(), common->end(), steps.begin(), steps.end(),
                            std::inserter(both, both.end()));
      steps = std::move(both);
    }
    common = std::move(steps);
  }
  // One file system, or hosts that all committed the same step: under this rank's root.
  if (!differ) return agreed ? std::optional<std::string>(files::join(root, *agreed)) : agreed;
  // Hosts that disagree (a node-local save that a crash committed on some of them only): the
  // newest step every host completed, under the name this rank's latest_checkpoint would use.
  if (!common || common->empty()) return std::nullopt;
  const std::string dir = step_dir(root, *common->rbegin());
  if (io.file_size(files::join(dir, ".metadata")) < 0 &&
      io.file_size(files::join(protocol::aside_of(dir), ".metadata")) >= 0)
    return protocol::aside_of(dir);
  return dir;
}

}  // namespace checkpoint
}  // namespace fsdp
