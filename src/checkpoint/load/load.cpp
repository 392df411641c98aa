// Loading DCP checkpoints into a StateDict (fsdp/checkpoint/checkpoint.h): CheckpointReader
// (dcp/reader.h) and load. Every item read is checked against the manifest's xxh3 checksum before
// it is decoded, so a corrupt byte is reported by name rather than fed to a decoder. verify and
// inspect, which read through the same CheckpointReader, are in verify.cpp.
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <optional>
#include <tuple>

#include "checkpoint/dcp/items.h"
#include "checkpoint/dcp/reader.h"
#include "checkpoint/formats/torch_archive.h"
#include "checkpoint/load/read_once.h"
#include "checkpoint/storage/files.h"
#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/errors.h"
#include "util/message.h"
#include "util/tensor_utils.h"

namespace fsdp {
namespace checkpoint {
namespace {

constexpr int64_t kMaxMetadata = int64_t{64} << 20;  // the pickle reader's limit

using dcp::Region;
using detail::msg;
using detail::quote;
using detail::shape;

int64_t volume(const Region& r) {
  int64_t v = 1;
  for (size_t d = 0; d < r.lo.size(); ++d) v *= r.hi[d] - r.lo[d];
  return v;
}

// Elements of `box` in none of `regions` (each inside the box). Chunks of a well-formed
// checkpoint are disjoint, and then volumes add up: no pass over the elements. Overlapping
// regions (a hostile or odd file) are counted exactly with a mask instead, so an overlap cannot
// hide a hole.
int64_t uncovered(const ShardMetadata& box, const std::vector<Region>& regions) {
  int64_t box_volume = 1;
  for (int64_t s : box.sizes) box_volume *= s;
  bool disjoint = regions.size() <= dcp::kMaxPairwiseBoxes;
  for (size_t i = 0; disjoint && i < regions.size(); ++i)
    for (size_t j = i + 1; disjoint && j < regions.size(); ++j)
      disjoint = !dcp::overlap(regions[i], regions[j]);
  if (disjoint) {
    int64_t held = 0;
    for (const auto& r : regions) held += volume(r);
    return box_volume - held;
  }
  at::Tensor covered = at::zeros(box.sizes, at::kBool);
  for (const auto& r : regions) {
    at::Tensor mark = covered;
    for (size_t d = 0; d < r.lo.size(); ++d)
      mark = mark.narrow(static_cast<int64_t>(d), r.lo[d] - box.offsets[d], r.hi[d] - r.lo[d]);
    mark.fill_(true);
  }
  return box_volume - covered.sum().item<int64_t>();
}

std::atomic<int64_t> direct_read_min_bytes{int64_t{256} << 10};

// Whether a chunk's bytes may be read into `t`'s memory as they are stored: a dense CPU tensor of
// the chunk's dtype, large enough that the extra reads of the archive around the record (its
// directory, head and tail: a few small preads) are paid back by the copy they save.
bool direct_target(const at::Tensor& t, at::ScalarType dtype) {
  return t.device().is_cpu() && t.layout() == at::kStrided && t.scalar_type() == dtype &&
         !t.is_quantized() && !t.is_conj() && !t.is_neg() && t.is_contiguous() &&
         static_cast<int64_t>(t.nbytes()) >= direct_read_min_bytes.load() &&
         t.data_ptr() != nullptr;
}

}  // namespace

void dcp::set_direct_read_min_bytes(int64_t bytes) { direct_read_min_bytes.store(bytes); }

void dcp::check_chunk(const at::Tensor& chunk, at::ScalarType dtype,
                      const std::vector<int64_t>& sizes, const std::string& where,
                      const char* what) {
  if (chunk.scalar_type() != dtype)
    throw ValueError(
        msg(what, ": ", where, " holds ", chunk.scalar_type(), ", the metadata says ", dtype));
  if (chunk.sizes().vec() != sizes)
    throw ValueError(msg(what, ": ", where, " has shape ", shape(chunk.sizes().vec()),
                         ", the metadata says ", shape(sizes)));
}

CheckpointReader::Files CheckpointReader::read_files(FileIO& io, const std::string& dir_in,
                                                     const char* what) {
  const std::string dir = files::normalize(dir_in);
  const std::string meta_path = files::join(dir, ".metadata");
  if (io.file_size(meta_path) < 0) {
    const std::string partial =
        files::join(files::parent_of(dir), "." + files::base_of(dir) + ".partial");
    throw ValueError(msg(what, ": ", meta_path, " does not exist: ",
                         io.is_dir(partial) == 1 ? msg("the save into ", dir, " did not complete (",
                                                       partial, " is left)")
                                                 : std::string("not a committed checkpoint")));
  }
  Files f;
  f.metadata = files::read_file(io, meta_path, kMaxMetadata, what);
  const std::string mf_path = files::join(dir, manifest::kFileName);
  if (io.file_size(mf_path) >= 0)
    f.manifest = files::read_file(io, mf_path, manifest::kMaxBytes, what);
  return f;
}

CheckpointReader::CheckpointReader(FileIO& io, const std::string& dir, bool verify,
                                   const char* what)
    : CheckpointReader(io, dir, read_files(io, dir, what), verify, what) {}

CheckpointReader::CheckpointReader(FileIO& io, const std::string& dir_in, const Files& f,
                                   bool verify, const char* what)
    : io_(io), dir_(files::normalize(dir_in)), verify_(verify), what_(what) {
  const std::string meta_path = files::join(dir_, ".metadata");
  if (f.manifest) {
    mf_ = manifest::parse(*f.manifest, files::join(dir_, manifest::kFileName));
    if (verify_ && files::xxh3_hex(f.metadata) != mf_->metadata_xxh3)
      throw ValueError(
          msg(what_, ": ", meta_path,
              " does not match its checksum in the manifest: the file is corrupt or was "
              "replaced"));
  }
  md_ = dcp::parse_metadata(f.metadata, meta_path);
  for (const auto& [k, item] : md_.state_dict_metadata) items_[k] = &item;
  for (const auto& [idx, info] : md_.storage_data) {
    if (idx.offset) {
      chunk_at_[{idx.fqn, *idx.offset}] = &info;
    } else {
      bytes_at_[idx.fqn] = &info;
    }
  }
}

const dcp::ItemMeta* CheckpointReader::item(const std::string& key) const {
  auto it = items_.find(key);
  return it == items_.end() ? nullptr : it->second;
}

char* CheckpointReader::Buffer::get(size_t n) {
  if (n > capacity_) {
    data_.reset();  // the old one first: peak memory is one buffer
    data_.reset(new char[n]);
    capacity_ = n;
  }
  return data_.get();
}

void CheckpointReader::check_digest(const std::string& key, const dcp::StorageInfo& info,
                                    const std::string& h) const {
  const manifest::Item* m = mf_->find(info.relative_path, info.offset);
  const std::string at = where(key, info);
  if (!m) throw CorruptionError(msg(what_, ": ", at, " has no checksum in the manifest"));
  if (m->length != info.length || m->key != key)
    throw CorruptionError(msg(what_, ": ", at, " disagrees with the manifest (which has ",
                              quote(m->key), ", ", m->length, " bytes)"));
  if (h != m->xxh3)
    throw CorruptionError(msg(what_, ": checksum mismatch for ", at, " (", info.length,
                              " bytes, xxh3 ", h, ", expected ", m->xxh3,
                              "): the file is corrupt"));
}

void CheckpointReader::read_hashed(const std::string& path, int64_t offset, int64_t length,
                                   char* out, files::Xxh3Stream* hash) const {
  // In blocks that stay in the cache, each hashed right after it is read: one pass over memory
  // for both, where reading everything first would read it back from memory to hash it.
  constexpr int64_t kBlock = int64_t{1} << 20;
  for (int64_t done = 0; done < length; done += kBlock) {
    const int64_t n = std::min(kBlock, length - done);
    files::pread_all(io_, path, offset + done, n, out + done, what_);
    if (hash) hash->update(out + done, static_cast<size_t>(n));
  }
}

std::string_view CheckpointReader::read_item(const std::string& key, const dcp::StorageInfo& info,
                                             Buffer& buf) const {
  const std::string path = files::join(dir_, info.relative_path);
  files::check_range(io_, path, info.offset, info.length, what_);  // before allocating
  files::Xxh3Stream hash;
  files::Xxh3Stream* h = verify_ && mf_ ? &hash : nullptr;
  char* data = buf.get(static_cast<size_t>(info.length));
  read_hashed(path, info.offset, info.length, data, h);
  if (h) check_digest(key, info, hash.hex());
  return {data, static_cast<size_t>(info.length)};
}

std::optional<at::Tensor> CheckpointReader::read_chunk_into(const std::string& key,
                                                            const dcp::StorageInfo& info, char* dst,
                                                            size_t dst_bytes, Buffer& buf) const {
  const std::string path = files::join(dir_, info.relative_path);
  files::check_range(io_, path, info.offset, info.length, what_);
  const int64_t len = info.length;
  // Where the storage record lies: only the zip directory is read for it (through the same
  // checked parser that decodes), nothing is decoded before the checksum has passed.
  archive::Record rec;
  try {
    const archive::Directory zip(
        len,
        [&](int64_t off, size_t n, char* out) {
          if (off < 0 || off > len || static_cast<int64_t>(n) > len - off)
            throw ValueError(msg(where(key, info), ": a read outside the item"));  // unreachable
          files::pread_all(io_, path, info.offset + off, static_cast<int64_t>(n), out, what_);
        },
        where(key, info));
    const archive::Record* only = nullptr;
    for (const auto& [name, r] : zip.records()) {
      if (name.compare(0, 5, "data/") != 0) continue;
      if (only) return std::nullopt;  // two storages: not a single chunk's layout
      only = &r;
    }
    if (!only || only->size != static_cast<int64_t>(dst_bytes)) return std::nullopt;
    rec = *only;
  } catch (const ValueError&) {
    return std::nullopt;
  }
  const auto head = static_cast<size_t>(rec.offset);
  const auto tail = static_cast<size_t>(len - rec.offset - rec.size);
  char* around = buf.get(head + tail);
  files::Xxh3Stream hash;
  files::Xxh3Stream* h = verify_ && mf_ ? &hash : nullptr;
  const int64_t record_end = info.offset + rec.offset + rec.size;
  read_hashed(path, info.offset, static_cast<int64_t>(head), around, h);
  read_hashed(path, info.offset + rec.offset, rec.size, dst, h);
  read_hashed(path, record_end, static_cast<int64_t>(tail), around + head, h);
  if (h) check_digest(key, info, hash.hex());
  items::ItemParts parts;
  parts.size = static_cast<size_t>(len);
  parts.parts = {{0, head, around},
                 {rec.offset, dst_bytes, dst},
                 {rec.offset + rec.size, tail, around + head}};
  return items::decode_tensor(parts, msg(what_, ": ", where(key, info)), check_crc());
}

std::string CheckpointReader::where(const std::string& key, const dcp::StorageInfo& info) const {
  return msg(quote(key), " in ", files::join(dir_, info.relative_path), " at offset ", info.offset);
}

void CheckpointReader::fill(StateDict& state_dict) const {
  Buffer buf;
  fill(state_dict, buf);
}

CheckpointReader::FillPlan::Read& CheckpointReader::FillPlan::read_of(const dcp::StorageInfo* info,
                                                                      const std::string& key,
                                                                      const dcp::ChunkMeta& chunk,
                                                                      at::ScalarType dtype) {
  Read& r = reads[info];
  r.key = key;
  r.sizes = chunk.sizes;
  r.dtype = dtype;
  return r;
}

void CheckpointReader::fill(StateDict& state_dict, Buffer& buf) const {
  FillPlan plan = this->plan(state_dict);
  apply(plan, buf);
}

CheckpointReader::FillPlan CheckpointReader::plan(StateDict& state_dict) const {
  FillPlan plan;
  for (const items::FlatItem& it : items::flatten(state_dict)) {
    StateValue& v = *it.value;
    auto found = items_.find(it.key);
    if (found == items_.end()) throw ValueError(msg(what_, ": ", dir_, " has no ", quote(it.key)));
    const dcp::ItemMeta& item = *found->second;
    if (v.is_tensor() || v.is_sharded_tensor()) {
      plan_tensor(it.key, item, v, plan);
      continue;
    }
    if (!item.bytes)
      throw ValueError(msg(what_, ": ", quote(it.key), " is a tensor in ", dir_,
                           ", the state dict holds a ", to_string(v.kind())));
    auto b = bytes_at_.find(it.key);
    if (b == bytes_at_.end())
      throw ValueError(msg(what_, ": no storage entry for ", quote(it.key), " in ", dir_));
    plan.values.push_back(FillPlan::Value{&v, b->second, it.key});
  }
  return plan;
}

void CheckpointReader::plan_tensor(const std::string& key, const dcp::ItemMeta& item, StateValue& v,
                                   FillPlan& plan) const {
  if (item.bytes) throw ValueError(msg(what_, ": ", quote(key), " is not a tensor in ", dir_));
  const std::vector<int64_t> shape =
      v.is_tensor() ? v.tensor().sizes().vec() : v.sharded_tensor().size();
  if (shape != item.tensor.size)
    throw ValueError(msg(what_, ": ", quote(key), " has shape ", detail::shape(item.tensor.size),
                         " in ", dir_, ", the state dict ", detail::shape(shape)));
  // An empty tensor needs no bytes, but its chunks are still read and checked, so that damage
  // anywhere in a data file is reported by the load that reads it.
  if (std::find(shape.begin(), shape.end(), 0) != shape.end()) {
    for (const auto& c : item.tensor.chunks) {
      auto info = chunk_at_.find({key, c.offsets});
      if (info != chunk_at_.end()) plan.read_of(info->second, key, c, item.tensor.dtype);
    }
  }
  // The boxes this rank holds of the tensor.
  std::vector<std::pair<ShardMetadata, at::Tensor>> boxes;
  if (v.is_tensor()) {
    boxes.emplace_back(ShardMetadata{std::vector<int64_t>(shape.size(), 0), shape, 0}, v.tensor());
  } else {
    for (const auto& s : v.sharded_tensor().local_shards())
      boxes.emplace_back(s.metadata, s.tensor);
  }
  for (const auto& [box, target] : boxes) {
    std::vector<Region> regions;  // the parts of the box that chunks hold
    for (const auto& c : item.tensor.chunks) {
      std::vector<int64_t> lo(shape.size()), hi(shape.size());
      bool overlap = true;
      for (size_t d = 0; d < shape.size(); ++d) {
        lo[d] = std::max(box.offsets[d], c.offsets[d]);
        hi[d] = std::min(box.offsets[d] + box.sizes[d], c.offsets[d] + c.sizes[d]);
        overlap = overlap && hi[d] > lo[d];
      }
      if (!overlap) continue;
      auto info = chunk_at_.find({key, c.offsets});
      if (info == chunk_at_.end())
        throw ValueError(msg(what_, ": no storage entry for ", quote(key), " chunk at ",
                             detail::shape(c.offsets), " in ", dir_));
      FillPlan::Copy cp;
      cp.dst = target;
      for (size_t d = 0; d < shape.size(); ++d) {
        cp.dst = cp.dst.narrow(static_cast<int64_t>(d), lo[d] - box.offsets[d], hi[d] - lo[d]);
        cp.src_lo.push_back(lo[d] - c.offsets[d]);
        cp.extent.push_back(hi[d] - lo[d]);
      }
      regions.push_back(Region{lo, hi});
      plan.read_of(info->second, key, c, item.tensor.dtype).copies.push_back(std::move(cp));
    }
    const int64_t missing = uncovered(box, regions);
    if (missing > 0)
      throw ValueError(msg(what_, ": ", missing, " element(s) of ", quote(key), " in the box at ",
                           detail::shape(box.offsets), " of size ", detail::shape(box.sizes),
                           " are in no chunk saved in ", dir_));
  }
}

void CheckpointReader::apply(FillPlan& plan, Buffer& buf) const {
  at::NoGradGuard no_grad;
  for (auto& [info, job] : plan.reads) {
    const std::string place = where(job.key, *info);
    // A chunk that fills one contiguous target whole (a shard loaded at the world size that saved
    // it, a tensor of an export) is read straight into the target: no pass through `buf`.
    if (job.copies.size() == 1) {
      at::Tensor& dst = job.copies[0].dst;
      if (dst.sizes().vec() == job.sizes && direct_target(dst, job.dtype)) {
        char* p = static_cast<char*>(dst.data_ptr());
        if (std::optional<at::Tensor> chunk =
                read_chunk_into(job.key, *info, p, dst.nbytes(), buf)) {
          dcp::check_chunk(*chunk, job.dtype, job.sizes, place, what_);
          if (chunk->data_ptr() == dst.data_ptr() && chunk->is_contiguous()) {
            dst.unsafeGetTensorImpl()->bump_version();  // written behind autograd's back
          } else {
            dst.copy_(chunk->clone());  // stored in another element order than the target's
          }
          continue;
        }
      }
    }
    apply_chunk(job, *info, read_item(job.key, *info, buf));
  }
  for (const auto& v : plan.values) apply_value(v, read_item(v.key, *v.info, buf));
}

void CheckpointReader::apply_chunk(const FillPlan::Read& job, const dcp::StorageInfo& info,
                                   std::string_view raw) const {
  at::NoGradGuard no_grad;
  const std::string place = where(job.key, info);
  // A view of `raw`: copied into the destinations before its buffer is used again.
  const at::Tensor chunk =
      items::decode_tensor(raw.data(), raw.size(), msg(what_, ": ", place), check_crc());
  dcp::check_chunk(chunk, job.dtype, job.sizes, place, what_);
  for (const auto& cp : job.copies) {
    at::Tensor src = chunk;
    for (size_t d = 0; d < cp.extent.size(); ++d)
      src = src.narrow(static_cast<int64_t>(d), cp.src_lo[d], cp.extent[d]);
    at::Tensor dst = cp.dst;
    dst.copy_(src);
  }
}

void CheckpointReader::apply_value(const FillPlan::Value& v, std::string_view raw) const {
  *v.target = items::decode_value(raw.data(), raw.size(), msg(what_, ": ", where(v.key, *v.info)),
                                  check_crc());
}

void load(StateDict& state_dict, const std::string& dir, const LoadOptions& options) {
  FileIO& io = options.io() ? *options.io() : default_file_io();
  if (options.group()) {
    read_once::load(state_dict, dir, io, options.verify(), *options.group());
    return;
  }
  const CheckpointReader reader(io, dir, options.verify(), read_once::kWhat);
  if (!reader.manifest())
    TORCH_WARN("fsdp checkpoint: ", reader.dir(), " has no ", manifest::kFileName,
               " (written by PyTorch?): its items are checked only by their zip CRC-32s");
  reader.fill(state_dict);
}

}  // namespace checkpoint
}  // namespace fsdp
