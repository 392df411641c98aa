// fsdp/checkpoint/async_save.h: checkpoints written while training goes on.
//
//   fsdp::checkpoint::AsyncSaver saver;                  // collective: makes its own group
//   for (step ...) {
//     train_step();
//     if (step % 100 == 0) saver.save_step(sd, "ckpt", step);  // blocks for a CPU copy only
//   }
//   saver.wait();                                         // the last save is committed
//
// A save first waits for the one before it (at most one is in flight) and throws that one's
// error, then copies every tensor of the state dict into CPU staging buffers (allocated on the
// first save and reused while the shapes stay the same), and returns: the caller may change its
// tensors at once. A background thread then writes the copy exactly as checkpoint::save does
// (atomic, checksummed), its exchanges going through a process group of the saver's own, so they
// never interleave with the training's collectives. Errors surface at the next save or wait().
#pragma once

#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "fsdp/checkpoint/checkpoint.h"

namespace fsdp {
namespace checkpoint {

class AsyncSaver {
 public:
  /// Collective over `options.group()` (the default group if null and one exists; a single
  /// process otherwise): creates the saver's own group over the same ranks.
  explicit AsyncSaver(const SaveOptions& options = {});
  /// Waits for a save in flight. An error it had is reported with a warning (a destructor cannot
  /// throw): call wait() first to see it.
  ~AsyncSaver();
  AsyncSaver(const AsyncSaver&) = delete;
  AsyncSaver& operator=(const AsyncSaver&) = delete;

  /// Snapshots `state_dict` and starts saving it to `dir` (checkpoint::save). Collective.
  void save(const StateDict& state_dict, const std::string& dir);
  /// The same into step_dir(root, step), then `latest` and keep_last (checkpoint::save_step).
  void save_step(const StateDict& state_dict, const std::string& root, int64_t step);
  /// Waits until the save in flight, if any, is committed; throws its error.
  void wait();
  /// Whether a save was started and not yet waited for.
  bool pending() const { return worker_.joinable(); }
  /// Bytes held in staging buffers.
  int64_t staging_bytes() const;

 private:
  SaveOptions options_;
  std::unique_ptr<dist::ProcessGroup> own_group_;
  std::vector<at::Tensor> staging_;
  std::thread worker_;
  std::exception_ptr error_;
};

}  // namespace checkpoint
}  // namespace fsdp
