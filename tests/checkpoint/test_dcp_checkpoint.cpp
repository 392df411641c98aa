// DCP checkpoints on disk (issue 11, first cut): save and load round trips at one and several
// ranks, resharding a wrapped model and its optimizer from W=2 to W=3, coverage and key errors,
// and stock PyTorch's dcp.load / dcp.save as the reference (LibTorch 2.x build with its Python).
#include <gtest/gtest.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <sstream>

#include <caffe2/serialize/inline_container.h>
#include <sys/stat.h>

#include "checkpoint/dcp/items.h"
#include "checkpoint/dcp/manifest.h"
#include "checkpoint/dcp/metadata.h"
#include "checkpoint/dcp/reader.h"
#include "dcp_model_testing.h"
#include "dcp_testing.h"
#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/checkpoint/state_dict.h"
#include "fsdp/errors.h"
#include "multi_rank.h"
#include "optim_testing.h"
#include "python_ref.h"
#include "state_dict_testing.h"
#include "tiny_lm.h"

namespace ckpt = fsdp::checkpoint;
namespace dcp = fsdp::checkpoint::dcp;
using fsdp::FullyShardedDataParallel;
using fsdp::ShardingStrategy;
using fsdp::StateDict;
using fsdp::StateList;
using fsdp::StateValue;
using fsdp::dist::ProcessGroup;
using fsdp::testing::error_of;
using fsdp::testing::run_ranks;
using fsdp::testing::TinyLM;
using namespace fsdp::testing;  // dcp_testing.h

namespace {

TEST(DcpCheckpoint, SaveAndLoadRoundTripInOneProcess) {
  fsdp::testing::TempDir tmp;
  run_ranks(1, [&](ProcessGroup&) {
    const StateDict sd = sample();
    ckpt::save(sd, tmp.file("c"));
    StateDict loaded = blank(StateValue(sd)).dict();
    ckpt::load(loaded, tmp.file("c"));
    EXPECT_EQ(values_text(flat_of(loaded)), values_text(flat_of(sd)));
    // Negative control: the comparison sees one changed element.
    StateDict other = sample();
    other.at("model").dict().at("w").tensor()[1][2] = 100;
    EXPECT_NE(values_text(flat_of(other)), values_text(flat_of(sd)));
    // A key the checkpoint lacks, a shape that differs: named, nothing loaded.
    StateDict extra = blank(StateValue(sd)).dict();
    extra.at("model").dict().insert_or_assign("nope", at::zeros({2}));
    EXPECT_NE(error_of([&] { ckpt::load(extra, tmp.file("c")); }).find("'model.nope'"),
              std::string::npos);
    StateDict wrong = blank(StateValue(sd)).dict();
    wrong.at("model").dict().insert_or_assign("w", at::zeros({4, 3}));
    EXPECT_NE(error_of([&] { ckpt::load(wrong, tmp.file("c")); }).find("'model.w' has shape"),
              std::string::npos);
    EXPECT_EQ(wrong.at("epoch").is_none(), true) << "nothing changed before the error";
    EXPECT_NE(error_of([&] { ckpt::load(extra, tmp.file("none")); }).find("does not exist"),
              std::string::npos);
  });
}

// A chunk that fills one contiguous target whole (a shard loaded at the world size that saved it,
// the rows of a whole tensor) is read straight into the target, so the reader's buffer holds only
// the few hundred bytes of archive around it; other targets (strided, or a box that cuts through
// chunks) go through the buffer. Every way gives the saved values bit for bit, moves the target's
// version counter as copy_ would, and names a flipped byte anywhere in the chunk.
TEST(DcpCheckpoint, LargeChunksAreReadStraightIntoTheirTargets) {
  fsdp::testing::TempDir tmp;
  const std::string dir = tmp.file("big");
  // 1.1 MB of float32 per chunk: read in two blocks, the second partial.
  constexpr int64_t kRows = 256, kCols = 1100;
  const at::Tensor full = at::arange(2 * kRows * kCols, at::kFloat).reshape({2 * kRows, kCols}) / 7;
  const at::Tensor dbl = at::arange(40000, at::kDouble) / 3;  // 312 KiB, saved by rank 0
  auto box = [&](int64_t row0, int64_t rows, at::Tensor local) {
    StateDict sd, model;
    model.insert_or_assign(
        "w", fsdp::ShardedTensor({2 * kRows, kCols}, at::kFloat,
                                 {{local, fsdp::ShardMetadata{{row0, 0}, {rows, kCols}, 0}}}));
    model.insert_or_assign("d", at::full({40000}, -1.0, at::kDouble));
    sd.insert_or_assign("model", model);
    return sd;
  };
  run_ranks(2, [&](ProcessGroup& pg) {
    StateDict sd = box(kRows * pg.rank(), kRows, full.narrow(0, kRows * pg.rank(), kRows).clone());
    sd.at("model").dict().insert_or_assign("d", dbl.clone());
    ckpt::save(sd, dir);
  });
  EXPECT_TRUE(ckpt::verify(dir).ok());
  const ckpt::CheckpointReader reader(ckpt::default_file_io(), dir, /*verify=*/true, "test");
  // What `t` holds of "model.w" equals the saved rows it covers, and "model.d" the saved values.
  auto check = [&](StateDict& t, int64_t row0, int64_t rows, const std::string& what) {
    const auto& w = t.at("model").dict().at("w").sharded_tensor().local_shards()[0].tensor;
    EXPECT_TRUE(at::equal(w, full.narrow(0, row0, rows))) << what;
    EXPECT_TRUE(at::equal(t.at("model").dict().at("d").tensor(), dbl)) << what;
  };
  {  // rank 1's shard as saved: straight in
    StateDict t = box(kRows, kRows, at::full({kRows, kCols}, -1.0));
    const at::Tensor target =
        t.at("model").dict().at("w").sharded_tensor().local_shards()[0].tensor;
    const auto version = target._version();
    ckpt::CheckpointReader::Buffer buf;
    reader.fill(t, buf);
    check(t, kRows, kRows, "rank 1's shard");
    EXPECT_LT(buf.capacity(), size_t{4096}) << "the chunks passed through the buffer";
    EXPECT_GT(target._version(), version) << "written behind autograd's back";
  }
  {  // the whole tensor (both chunks fill whole row ranges of it): straight in
    StateDict t = box(0, 2 * kRows, at::full({2 * kRows, kCols}, -1.0));
    ckpt::CheckpointReader::Buffer buf;
    reader.fill(t, buf);
    check(t, 0, 2 * kRows, "the whole tensor");
    EXPECT_LT(buf.capacity(), size_t{4096});
  }
  {  // a strided target and a box across both chunks: through the buffer
    StateDict t = box(0, 2 * kRows, at::full({kCols, 2 * kRows}, -1.0).t());
    ckpt::CheckpointReader::Buffer buf;
    reader.fill(t, buf);
    check(t, 0, 2 * kRows, "a transposed target");
    EXPECT_GE(buf.capacity(), size_t{kRows * kCols * 4});
    StateDict across = box(kRows / 2, kRows, at::full({kRows, kCols}, -1.0));
    ckpt::load(across, dir);
    check(across, kRows / 2, kRows, "a box across two chunks");
  }
  // A flipped byte at the start, in the middle (tensor data) and at the end (the zip directory)
  // of rank 1's chunk: named by the checksum; without the manifest, the middle one by the zip's
  // CRC-32 and the end one by the archive's parser.
  const auto mf = ckpt::manifest::parse(read_bytes(dir + "/.fsdp_manifest.json"), "manifest");
  const ckpt::manifest::Item* item = nullptr;
  for (const auto& i : mf.items)
    if (i.key == "model.w" && i.length > kRows * kCols * 4 && i.file == "__1_0.distcp") item = &i;
  ASSERT_NE(item, nullptr);
  const std::string path = dir + "/" + item->file;
  const std::string good = read_bytes(path);
  auto load_with_flip = [&](int64_t at) {
    std::string bad = good;
    bad[static_cast<size_t>(at)] ^= 0x10;
    write_bytes(path, bad);
    StateDict t = box(kRows, kRows, at::full({kRows, kCols}, -1.0));
    const std::string err = error_of([&] { ckpt::load(t, dir); });
    // verify reads every item through the buffer, block by block as well, and names this one
    // (beside the missing manifest, once it is gone).
    const ckpt::VerifyReport rep = ckpt::verify(dir);
    EXPECT_EQ(std::count_if(rep.problems.begin(), rep.problems.end(),
                            [&](const std::string& p) {
                              return p.find("'model.w' in " + path) != std::string::npos;
                            }),
              1)
        << "@" << at;
    write_bytes(path, good);
    return err;
  };
  const int64_t first = item->offset, middle = item->offset + item->length / 2,
                last = item->offset + item->length - 1;
  for (int64_t at : {first, middle, last}) {
    const std::string err = load_with_flip(at);
    EXPECT_NE(err.find("checksum mismatch for 'model.w' in " + path), std::string::npos)
        << "@" << at << ": " << err;
  }
  ASSERT_EQ(::rename((dir + "/.fsdp_manifest.json").c_str(), (dir + "/manifest.away").c_str()), 0);
  const std::string crc = load_with_flip(middle), zip = load_with_flip(last);
  EXPECT_NE(crc.find("fails its CRC-32"), std::string::npos) << crc;
  EXPECT_NE(zip.find("not a torch.save archive"), std::string::npos) << zip;
  for (const std::string& err : {crc, zip})
    EXPECT_NE(err.find("'model.w' in " + path), std::string::npos) << err;
  const std::string header = load_with_flip(first);  // the first record's local header
  EXPECT_NE(header.find("'model.w' in " + path), std::string::npos) << header;
}

// The zip end record is found whether the archive ends with it (torch.save, read from its last 22
// bytes) or with a comment after it (anything up to 64 KiB, read from the wider window).
TEST(DcpCheckpoint, ArchivesWithAndWithoutAZipCommentDecode) {
  const at::Tensor t = at::arange(1000, at::kFloat);
  std::string item;
  ckpt::items::write_tensor_item(t, [&](const char* d, size_t n) { item.append(d, n); });
  auto decode = [](const std::string& bytes) {
    return ckpt::items::decode_tensor(bytes.data(), bytes.size(), "item", /*check_crc=*/true);
  };
  EXPECT_TRUE(at::equal(decode(item), t));
  for (size_t comment : {size_t{1}, size_t{300}, size_t{65535}}) {
    std::string with = item;
    with[with.size() - 2] = static_cast<char>(comment & 0xFF);
    with[with.size() - 1] = static_cast<char>(comment >> 8);
    with.append(comment, 'c');
    EXPECT_TRUE(at::equal(decode(with), t)) << comment << "-byte comment";
  }
  // Negative control: a comment length that does not reach the end of the archive.
  std::string bad = item;
  bad[bad.size() - 2] = 5;
  EXPECT_NE(error_of([&] { decode(bad); }).find("no zip end-of-directory record"),
            std::string::npos);
}

// Damaged files are errors naming the file, never crashes (silent corruption of tensor bytes
// needs the checksums still to come).
TEST(DcpCheckpoint, DamagedFilesAreErrors) {
  fsdp::testing::TempDir tmp;
  run_ranks(1, [&](ProcessGroup&) {
    ckpt::save(sample(), tmp.file("c"));
    const std::string data = tmp.file("c") + "/__0_0.distcp";
    std::string bytes;
    {
      std::ifstream f(data, std::ios::binary);
      bytes.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
    }
    auto write = [&](const std::string& b) { std::ofstream(data, std::ios::binary) << b; };
    auto load_error = [&] {
      StateDict t = blank(StateValue(sample())).dict();
      return error_of([&] { ckpt::load(t, tmp.file("c")); });
    };
    write(bytes.substr(0, bytes.size() / 2));  // truncated
    EXPECT_NE(load_error().find("__0_0.distcp has"), std::string::npos) << load_error();
    std::string garbage = bytes;  // every item's archive overwritten
    for (size_t i = 0; i < garbage.size(); i += 7) garbage[i] = static_cast<char>(i * 31);
    write(garbage);
    EXPECT_NE(load_error().find("__0_0.distcp"), std::string::npos) << load_error();
    write(bytes);
    EXPECT_EQ(load_error(), "(no error)");
    std::ofstream(tmp.file("c") + "/.metadata", std::ios::binary) << "not a pickle";
    EXPECT_NE(load_error().find(".metadata"), std::string::npos) << load_error();
  });
}

// A value whose pickle makes a list contain itself (through the memo) is an error, not an
// endless recursion, and the reader refuses it itself: a cycle of shared pointers left to a
// later stage would never be freed (LeakSanitizer found that one, scripts/sanitize.sh).
TEST(DcpCheckpoint, SelfContainingValueIsAnError) {
  fsdp::testing::TempDir tmp;
  run_ranks(1, [&](ProcessGroup&) {
    std::string archive;
    {
      caffe2::serialize::PyTorchStreamWriter w([&](const void* d, size_t n) {
        archive.append(static_cast<const char*>(d), n);
        return n;
      });
      const std::string pkl(
          "\x80\x02]q\x00h\x00"
          "a.",
          9);  // l = []; l.append(l)
      w.writeRecord("data.pkl", pkl.data(), pkl.size());
      w.writeEndOfFile();
    }
    const std::string dir = tmp.file("c");
    ::mkdir(dir.c_str(), 0755);
    std::ofstream(dir + "/__0_0.distcp", std::ios::binary) << archive;
    dcp::Metadata m;
    dcp::ItemMeta item;
    item.bytes = true;
    m.state_dict_metadata.emplace_back("x", item);
    m.storage_data.push_back({{"x", std::nullopt, std::nullopt},
                              {"__0_0.distcp", 0, static_cast<int64_t>(archive.size())}});
    std::ofstream(dir + "/.metadata", std::ios::binary) << dcp::serialize_metadata(m);
    StateDict sd;
    sd.insert_or_assign("x", StateValue());
    const std::string err = error_of([&] { ckpt::load(sd, dir); });
    EXPECT_NE(err.find("a value contains itself (through the memo)"), std::string::npos) << err;
  });
}

// Saved chunks that leave part of a tensor uncovered: the load names the key and the count.
TEST(DcpCheckpoint, UncoveredElementsAreNamed) {
  fsdp::testing::TempDir tmp;
  run_ranks(1, [&](ProcessGroup&) {
    const at::Tensor full = at::arange(20, at::kFloat).reshape({5, 4});
    StateDict sd;  // only rows 0..2 of 5 are saved
    sd.insert_or_assign(
        "t", fsdp::ShardedTensor({5, 4}, at::kFloat,
                                 {fsdp::Shard{full.narrow(0, 0, 3).clone(), {{0, 0}, {3, 4}, 0}}}));
    ckpt::save(sd, tmp.file("c"));
    StateDict whole;
    whole.insert_or_assign("t", at::zeros({5, 4}));
    EXPECT_NE(error_of([&] { ckpt::load(whole, tmp.file("c")); }).find("8 element(s) of 't'"),
              std::string::npos);
    StateDict top;  // what is covered loads
    top.insert_or_assign("t", fsdp::chunk_sharded(at::zeros({5, 4}), 0, 2));  // rows 0..2
    ckpt::load(top, tmp.file("c"));
    EXPECT_TRUE(
        torch::equal(top.at("t").sharded_tensor().local_shards()[0].tensor, full.narrow(0, 0, 3)));
    // Overlapping chunks whose volumes add up to the tensor's (rows 0..2 and 1..2: 12 + 8 = 20)
    // still leave rows 3..4 uncovered; the overlap must not hide the hole.
    StateDict overlapping;
    overlapping.insert_or_assign(
        "t", fsdp::ShardedTensor({5, 4}, at::kFloat,
                                 {fsdp::Shard{full.narrow(0, 0, 3).clone(), {{0, 0}, {3, 4}, 0}},
                                  fsdp::Shard{full.narrow(0, 1, 2).clone(), {{1, 0}, {2, 4}, 0}}}));
    ckpt::save(overlapping, tmp.file("o"));
    EXPECT_NE(error_of([&] { ckpt::load(whole, tmp.file("o")); }).find("8 element(s) of 't'"),
              std::string::npos);
  });
}

// The acceptance scenario: a wrapped model and its optimizer saved at W=2 (FULL_SHARD, flat
// parameters, each rank's flat shards as they lie) load at W=3 under SHARD_GRAD_OP with
// use_orig_params, and into the unwrapped model at W=1, bit-exactly.
// The pieces of `value` (a parameter's or its state's) are this rank's flat shard of parameter
// `i` of `h`, as it lies: the boxes of its range, holding the shard's elements.
void expect_as_stored(const StateValue& value, const fsdp::FlatParamHandle& h, size_t i,
                      const at::Tensor& flat_shard, const std::string& what) {
  ASSERT_TRUE(value.is_sharded_tensor()) << what;
  const auto& pieces = value.sharded_tensor().local_shards();
  const fsdp::ShardParamInfo& s = h.shard_param_infos()[i];
  const auto boxes = s.in_shard
                         ? fsdp::flat_range_boxes(h.layout().shapes[i], s.intra_param_start_idx,
                                                  s.numel_in_shard, h.rank())
                         : std::vector<fsdp::ShardMetadata>{};
  ASSERT_EQ(pieces.size(), boxes.size()) << what;
  int64_t at_ = s.offset_in_shard;
  for (size_t b = 0; b < boxes.size(); ++b) {
    EXPECT_EQ(pieces[b].metadata, boxes[b]) << what;
    const int64_t n = pieces[b].tensor.numel();
    EXPECT_TRUE(torch::equal(pieces[b].tensor.reshape({-1}), flat_shard.narrow(0, at_, n))) << what;
    at_ += n;
  }
}

TEST(DcpCheckpoint, WrappedModelSavedAtTwoLoadsAtThree) {
  fsdp::testing::TempDir tmp, ref;
  run_ranks(2, [&](ProcessGroup& pg) {
    TinyLM m(7);
    FullyShardedDataParallel model(m, fsdp::testing::lm_options(m));
    auto opt =
        fsdp::testing::make_optimizer("Adam", fsdp::testing::unique_params(model->parameters()));
    int gathered = 0;
    StateDict sd = train_two_steps(model, *opt, pg.rank(), [&](int64_t) { ++gathered; });
    EXPECT_EQ(gathered, 0) << "get_state_dict gathered a unit";
    // Flat shards saved as they lie: every piece is this rank's part of its flat parameter (and
    // of the flat parameter's Adam state), cut into boxes, with no unit ever gathered.
    size_t checked = 0;
    for (auto* h : model->handles()) {
      const at::Tensor flat = h->flat_param().detach();
      auto state = opt->state().find(fsdp::compat::optim_state_key(h->flat_param()));
      if (state == opt->state().end()) continue;  // the frozen unit: no optimizer state
      const at::Tensor exp_avg =
          static_cast<torch::optim::AdamParamState&>(*state->second).exp_avg();
      for (size_t i = 0; i < h->layout().fqns.size(); ++i) {
        const std::string& fqn = h->layout().fqns[i];
        expect_as_stored(sd.at("model").dict().at(fqn), *h, i, flat, fqn);
        expect_as_stored(sd.at("optim").dict().at("state").dict().at(fqn).dict().at("exp_avg"), *h,
                         i, exp_avg, fqn + " exp_avg");
        ++checked;
      }
    }
    EXPECT_GT(checked, 5u);
    ckpt::save(sd, tmp.file("step2"));
    save_reference_state(model, *opt, ref.path(), pg.rank());
  });
  run_ranks(3, [&](ProcessGroup&) {
    TinyLM m(99);
    FullyShardedDataParallel model(
        m, fsdp::testing::lm_options(m, ShardingStrategy::SHARD_GRAD_OP, true));
    auto opt =
        fsdp::testing::make_optimizer("Adam", fsdp::testing::unique_params(model->parameters()));
    load_checkpoint(model, *opt, tmp.file("step2"));
    expect_reference_state(model, *opt, ref.path(), "W=3");
  });
  // And into the model unwrapped, at W=1: a plain module and a plain optimizer.
  run_ranks(1, [&](ProcessGroup&) {
    TinyLM m(98);
    auto opt = fsdp::testing::make_optimizer("Adam", fsdp::testing::unique_params(m->parameters()));
    load_checkpoint(m, *opt, tmp.file("step2"));
    expect_reference_state(m, *opt, ref.path(), "unwrapped");
  });
  // Stock PyTorch loads the W=2 checkpoint (chunks from two files) whole, with the same values.
  if (!fsdp::testing::python().empty()) {
    StateDict full;
    full.insert_or_assign("model", fsdp::testing::load_pieces(1, ref.path(), "m_"));
    full.insert_or_assign("optim", fsdp::testing::load_osd(1, ref.path()));
    EXPECT_EQ(
        fsdp::testing::run_command(fsdp::testing::dcp_python() + "values " + tmp.file("step2")),
        values_text(flat_of(full)));
  }
}

// HYBRID_SHARD: each replica group holds the same pieces. Every piece is written once (by the
// lowest rank holding it, as DCP's dedup_save_plans), so the second replica group's files are
// empty and the checkpoint holds no chunk twice (which load would refuse).
TEST(DcpCheckpoint, HybridShardReplicasWriteEachPieceOnce) {
  fsdp::testing::TempDir tmp, ref;
  run_ranks(4, [&](ProcessGroup& pg) {
    TinyLM m(7);
    FullyShardedDataParallel model(
        m, fsdp::testing::lm_options(m, ShardingStrategy::HYBRID_SHARD).hybrid_shard_size(2));
    auto opt =
        fsdp::testing::make_optimizer("Adam", fsdp::testing::unique_params(model->parameters()));
    StateDict sd = train_two_steps(model, *opt, pg.rank());
    ckpt::save(sd, tmp.file("hsdp"));
    save_reference_state(model, *opt, ref.path(), pg.rank());
  });
  struct stat st {};
  for (int r = 0; r < 4; ++r) {
    const std::string file = tmp.file("hsdp") + "/__" + std::to_string(r) + "_0.distcp";
    ASSERT_EQ(::stat(file.c_str(), &st), 0) << file;
    if (r < 2)
      EXPECT_GT(st.st_size, 0) << file;
    else
      EXPECT_EQ(st.st_size, 0) << file << ": a replica wrote pieces rank " << r - 2 << " wrote";
  }
  EXPECT_TRUE(ckpt::verify(tmp.file("hsdp")).ok());
  run_ranks(1, [&](ProcessGroup&) {
    TinyLM m(98);
    auto opt = fsdp::testing::make_optimizer("Adam", fsdp::testing::unique_params(m->parameters()));
    load_checkpoint(m, *opt, tmp.file("hsdp"));
    expect_reference_state(m, *opt, ref.path(), "W=1");
  });
}

// Stock PyTorch's dcp.load reads our checkpoint with equal values; ours reads dcp.save's.
TEST(DcpCheckpoint, PythonLoadsOursAndWeLoadPythons) {
  if (fsdp::testing::python().empty())
    GTEST_SKIP() << "no Python with torch >= 2 and DCP (the trixie chroot has one)";
  fsdp::testing::TempDir tmp;
  run_ranks(1, [&](ProcessGroup&) {
    const StateDict sd = sample();
    ckpt::save(sd, tmp.file("ours"));
    // Python's template is flat (DCP keys); bytes values print as Python reprs.
    EXPECT_EQ(
        fsdp::testing::run_command(fsdp::testing::dcp_python() + "values " + tmp.file("ours")),
        values_text(flat_of(sd)));

    fsdp::testing::run_command(fsdp::testing::dcp_python() + "save " + tmp.file("theirs"));
    StateDict theirs = blank(StateValue(sample())).dict();
    theirs.at("model").dict().erase("e");  // dcp_python.py's dict has no empty tensor
    theirs.erase("name");
    theirs.at("optim").dict().at("param_groups").list()[0].dict().erase("amsgrad");
    theirs.at("model").dict().insert_or_assign("big", at::full({300, 400}, -1.0));
    theirs.at("model").dict().insert_or_assign("big_t", at::full({300, 400}, -1.0));
    ckpt::load(theirs, tmp.file("theirs"));
    const StateDict& m = theirs.at("model").dict();
    const at::Tensor big = at::arange(300 * 400, at::kFloat).reshape({300, 400});
    EXPECT_TRUE(torch::equal(m.at("big").tensor(), big));
    EXPECT_TRUE(torch::equal(m.at("big_t").tensor(), big.reshape({400, 300}).t()));
    EXPECT_TRUE(torch::equal(m.at("w").tensor(), at::arange(12, at::kFloat).reshape({3, 4})));
    EXPECT_TRUE(torch::equal(m.at("i").tensor(), at::tensor({1, 2}, at::kLong)));
    EXPECT_EQ(m.at("s").tensor().item<double>(), 2.5);
    EXPECT_EQ(theirs.at("epoch").to_int(), 7);
    const StateDict& g = theirs.at("optim").dict().at("param_groups").list()[0].dict();
    EXPECT_DOUBLE_EQ(g.at("lr").to_double(), 0.01);
    EXPECT_EQ(py_repr(g.at("betas")), "[0.9, 0.999]");
    EXPECT_EQ(py_repr(g.at("params")), "['w']");
  });
}

// Python FSDP on the other side (issue 11's acceptance): fsdp-cpp saves a trained TinyLM and its
// Adam state at W=2 (FULL_SHARD, flat parameters), and Python FSDP at W=2 (use_orig_params) loads
// it with stock dcp.load through get_state_dict / set_state_dict; Python FSDP trains and saves at
// W=2, and fsdp-cpp loads that at W=3 (SHARD_GRAD_OP, original parameters). Both sides print
// every tensor of the full model and optimizer state, which must match exactly.
std::string tensor_lines_of(const StateDict& fm, const StateDict& fo) {
  StateDict full;
  full.insert_or_assign("model", fm);
  full.insert_or_assign("optim", fo);
  std::string out;
  std::istringstream in(values_text(flat_of(full)));
  for (std::string line; std::getline(in, line);)
    if (line.find(" value ") == std::string::npos) out += line + "\n";
  return out;
}

std::string fsdp_python(const std::string& args) {
  return fsdp::testing::run_command(fsdp::testing::python() + " -W ignore " +
                                    std::string(FSDP_TEST_SOURCE_DIR) + "/dcp/fsdp_dcp.py " + args);
}

TEST(DcpCheckpoint, PythonFsdpLoadsOursAndWeLoadPythonFsdps) {
  if (fsdp::testing::python().empty())
    GTEST_SKIP() << "no Python with torch >= 2 and DCP (the trixie chroot has one)";
  fsdp::testing::TempDir tmp;
  const std::string ours = tmp.file("ours"), theirs = tmp.file("theirs"), ref = tmp.file("ref");
  run_ranks(2, [&](ProcessGroup& pg) {
    TinyLM m(7);
    FullyShardedDataParallel model(m, fsdp::testing::lm_options(m));
    auto opt =
        fsdp::testing::make_optimizer("Adam", fsdp::testing::unique_params(model->parameters()));
    StateDict sd = train_two_steps(model, *opt, pg.rank());
    ckpt::save(sd, ours);
    auto [fm, fo] =
        ckpt::get_state_dict(model, *opt, ckpt::StateDictOptions().full_state_dict(true));
    if (pg.rank() == 0) std::ofstream(ref) << tensor_lines_of(fm, fo);
  });
  std::string want;
  {
    std::ifstream f(ref);
    want.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  }
  ASSERT_NE(want.find("optim.state.tok.weight.exp_avg float32"), std::string::npos) << want;
  EXPECT_EQ(fsdp_python("load " + ours + " 2"), want);

  const std::string python_state = fsdp_python("save " + theirs + " 2");
  ASSERT_NE(python_state.find("model.tok.weight float32"), std::string::npos) << python_state;
  EXPECT_NE(python_state, want) << "the comparison tells two trainings apart";
  run_ranks(3, [&](ProcessGroup& pg) {
    TinyLM m(99);
    FullyShardedDataParallel model(
        m, fsdp::testing::lm_options(m, ShardingStrategy::SHARD_GRAD_OP, true));
    // As the Python side: an optimizer over the trainable parameters only (the frozen layer's
    // are in no group), so the saved param groups match.
    std::vector<at::Tensor> trainable;
    for (const auto& p : fsdp::testing::unique_params(model->parameters()))
      if (p.requires_grad()) trainable.push_back(p);
    auto opt = fsdp::testing::make_optimizer("Adam", trainable);
    load_checkpoint(model, *opt, theirs);
    auto [fm, fo] =
        ckpt::get_state_dict(model, *opt, ckpt::StateDictOptions().full_state_dict(true));
    if (pg.rank() == 0) {
      EXPECT_EQ(tensor_lines_of(fm, fo), python_state);
    }
  });
}

}  // namespace
