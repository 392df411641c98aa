// fsdp/checkpoint/checkpoint.h: saving and loading a StateDict as a PyTorch DCP checkpoint
// directory (torch.distributed.checkpoint's FileSystem layout, docs/checkpoint_format.md), so
// that stock Python's dcp.load reads what we save and we load what dcp.save wrote.
//
//   auto [msd, osd] = fsdp::checkpoint::get_state_dict(model, opt);
//   fsdp::StateDict sd;
//   sd.insert_or_assign("model", msd);
//   sd.insert_or_assign("optim", osd);
//   fsdp::checkpoint::save(sd, "ckpt/step_100");          // every rank writes its own pieces
//   ...
//   fsdp::checkpoint::load(sd, "ckpt/step_100");          // fills sd's tensors in place
//   fsdp::checkpoint::set_state_dict(model, opt, sd.at("model").dict(), sd.at("optim").dict());
//
// Keys are DCP's (PyTorch 2.4+): nested dicts joined with dots, and lists by index where they hold
// dicts, tensors or such lists ("optim.state.fc.weight.exp_avg", "optim.param_groups.0.lr"); a
// list of plain values such as "params" or "betas" is one value. Every ShardedTensor piece is a chunk saved by the rank holding it (no
// tensor moves between ranks); plain tensors and other values are saved once, by rank 0.
//
// This is the first cut of issue 11's checkpoint layer. Not yet: atomic commit (data is written
// in place and `.metadata` last, as DCP does), checksums and the manifest, async save, exports.
#pragma once

#include <string>

#include "fsdp/dist.h"
#include "fsdp/state_dict.h"

namespace fsdp {
namespace checkpoint {

/// Writes `state_dict` to the directory `dir` (created if missing): this rank's chunks into
/// `dir/__<rank>_0.distcp`, then rank 0 writes `dir/.metadata`. Collective over `group` (the
/// default group if null and one exists; a single process otherwise): one metadata all-gather,
/// no tensor traffic. Throws ValueError for values DCP cannot hold and Error for I/O failures,
/// naming the file.
void save(const StateDict& state_dict, const std::string& dir, dist::ProcessGroup* group = nullptr);

/// Fills `state_dict` (a template: plain tensors receive whole values, ShardedTensor pieces their
/// boxes, other values are replaced) from the checkpoint in `dir`, written at any world size.
/// Each rank reads only the chunks overlapping what it holds. Throws ValueError naming the key
/// for a key the checkpoint lacks, a shape that differs, or elements no saved chunk covers (with
/// the uncovered count) before anything in `state_dict` is changed; a data file that is short or
/// does not decode is a ValueError naming the file and offset, possibly after other values were
/// filled (checksums, to catch silent corruption, are still to come). Local: no communication.
void load(StateDict& state_dict, const std::string& dir);

}  // namespace checkpoint
}  // namespace fsdp
