// fsdp/checkpoint/export.h: consolidated weights for the rest of the world, and back.
//
// Exports write plain (unsharded) tensors as
//  - Hugging Face safetensors: `model.safetensors`, or above `max_shard_bytes`
//    `model-0000k-of-0000n.safetensors` plus `model.safetensors.index.json`;
//  - a `.pt` file that Python's `torch.load(path, weights_only=True)` reads (a plain dict of
//    tensors, as `torch.save(model.state_dict())` writes, without the TorchScript wrapping of
//    `torch::save`).
// From a checkpoint directory they stream: one tensor is assembled from its chunks, written and
// dropped before the next, so memory stays at about the largest tensor. From a StateDict they
// write what is in memory (e.g. a FULL state dict on rank 0).
//
// Imports read both formats, written by us or by Python (`safetensors.torch.save_file`,
// `torch.save(model.state_dict())`), into a flat StateDict of CPU tensors that
// set_model_state_dict / load_state_dict take at any world size. `.pt` files are read by the
// restricted unpickler: only tensors, dicts (OrderedDict), lists, tuples, numbers, strings and
// None; anything else is an error naming the class, and nothing in the file is executed.
//
//   fsdp::checkpoint::export_safetensors("ckpt/step_100", "hf_out");   // keys under "model."
//   fsdp::StateDict w = fsdp::checkpoint::load_safetensors("hf_out");
#pragma once

#include <torch/arg.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/state_value.h"

namespace fsdp {
namespace checkpoint {

/// How export_safetensors(), save_safetensors(), export_pt() and save_pt() write their files.
struct ExportOptions {
  /// Which checkpoint keys to export, and the part of their names to drop. "" exports every
  /// tensor under its full DCP key. Unset (the default), the layout decides: "model." for a
  /// {"model": ..., "optim": ...} checkpoint (fsdp-train's, and PyTorch's get_state_dict recipes:
  /// tensors under "model." and anything under "optim.", or every tensor under "model."), which
  /// exports the model under its own parameter names; "" for anything else, such as a plain model
  /// state dict (`dcp.save(get_model_state_dict(model))`). A plain model whose every key starts
  /// with "model." is indistinguishable from the first: pass "" for it.
  TORCH_ARG(std::optional<std::string>, prefix);
  /// safetensors: split into several files so that none holds more than this many bytes of
  /// tensors (a tensor larger than that gets a file of its own). Default 0: one file.
  TORCH_ARG(int64_t, max_shard_bytes) = 0;
  /// safetensors: strings recorded in the header's `__metadata__` ("format": "pt" is always
  /// added, as transformers expects). Default: none besides "format".
  TORCH_ARG(Annotations, metadata);
  /// Where file operations go. Null: default_file_io().
  TORCH_ARG(FileIOPtr, io) = nullptr;
};

/// Exports the tensors of the checkpoint in `checkpoint_dir` as safetensors into the directory
/// `out_dir` (created if missing). Returns the files written. Throws ValueError naming the key
/// for a dtype safetensors cannot hold, and for a prefix that matches no tensor.
std::vector<std::string> export_safetensors(const std::string& checkpoint_dir,
                                            const std::string& out_dir,
                                            const ExportOptions& options = {});
/// The same from tensors in memory (plain tensors; a nested dict is flattened with dots, and
/// only keys under `prefix` are written).
std::vector<std::string> save_safetensors(const StateDict& state_dict, const std::string& out_dir,
                                          const ExportOptions& options = {});

/// Exports the tensors of the checkpoint as one `.pt` file at `out_file`.
void export_pt(const std::string& checkpoint_dir, const std::string& out_file,
               const ExportOptions& options = {});
void save_pt(const StateDict& state_dict, const std::string& out_file,
             const ExportOptions& options = {});

/// Reads safetensors: a `.safetensors` file, a `model.safetensors.index.json`, or a directory
/// holding either. Every header is validated (size limit, dtypes, shapes, offsets inside the
/// file, no overlaps) before any tensor is allocated; errors name the file and tensor.
StateDict load_safetensors(const std::string& path, FileIO* io = nullptr);

/// Reads a `.pt` file holding a dict of tensors (nested dicts, lists and plain values allowed),
/// through `io`, each storage straight into its tensor and checked against its CRC-32. Tensors
/// that share a storage in the file (tied weights, views) share it here too, as with torch.load.
StateDict load_pt(const std::string& path, FileIO* io = nullptr);

}  // namespace checkpoint
}  // namespace fsdp
