// Exports and imports (issue 11): a W=2 checkpoint exported to safetensors (one file and split
// with an index) and to `.pt`, read back bit-exactly by us and by Python (torch.load with
// weights_only=True, safetensors.torch); Python-written files imported; memory while streaming;
// and hostile files rejected with clear errors.
#include <gtest/gtest.h>

#include <caffe2/serialize/inline_container.h>
#include <sys/stat.h>
#include <torch/serialize.h>

#include <fstream>
#include <iterator>

#include "checkpoint/dcp/items.h"
#include "checkpoint/formats/torch_archive.h"
#include "dcp_testing.h"
#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/checkpoint/export.h"
#include "fsdp/errors.h"
#include "fuzz/targets.h"
#include "fuzz_regressions.h"
#include "memory_watch.h"
#include "multi_rank.h"
#include "python_ref.h"
#include "state_dict_testing.h"

namespace ckpt = fsdp::checkpoint;
using fsdp::ShardedTensor;
using fsdp::ShardMetadata;
using fsdp::StateDict;
using fsdp::StateValue;
using fsdp::dist::ProcessGroup;
using fsdp::testing::error_of;
using fsdp::testing::read_bytes;
using fsdp::testing::run_ranks;
using fsdp::testing::TempDir;
using fsdp::testing::write_bytes;

namespace {

#ifdef FSDP_TEST_TORCH_PYTHON
const std::string kPython = FSDP_TEST_TORCH_PYTHON;
#else
const std::string kPython;
#endif

std::string py(const std::string& args) {
  return fsdp::testing::run_command(kPython + " -W ignore " + std::string(FSDP_TEST_SOURCE_DIR) +
                                    "/dcp/export_python.py " + args);
}

bool has_safetensors() {
  return !kPython.empty() &&
         std::system((kPython + " -c 'import safetensors.torch' 2>/dev/null").c_str()) == 0;
}

std::string py_float(double x) { return fsdp::testing::py_float(x); }

// What export_python.py prints for a flat dict of tensors.
std::string tensor_lines(const StateDict& flat) {
  std::vector<std::string> lines;
  for (const auto& [k, v] : flat) {
    const at::Tensor t = v.tensor();
    std::string shape;
    for (int64_t d = 0; d < t.dim(); ++d) shape += (d ? "," : "") + std::to_string(t.size(d));
    std::string vals;
    const at::Tensor f = t.to(at::kDouble).reshape({-1});
    for (int64_t i = 0; i < f.numel(); ++i) vals += (i ? "," : "") + py_float(f[i].item<double>());
    const std::map<std::string, std::string> names{
        {"Float", "float32"}, {"BFloat16", "bfloat16"}, {"Long", "int64"}, {"Double", "float64"}};
    lines.push_back(k + " " + names.at(c10::toString(t.scalar_type())) + " " +
                    (shape.empty() ? "-" : shape) + " " + vals);
  }
  std::sort(lines.begin(), lines.end());
  std::string out;
  for (const auto& l : lines) out += l + "\n";
  return out;
}

// The model part of a W-rank checkpoint: "model.w" (6 x 5) sharded by rows, plus plain tensors,
// and an optimizer part the default prefix leaves out.
StateDict model_sample(int rank, int world) {
  const at::Tensor full = at::arange(30, at::kFloat).reshape({6, 5}) / 4;
  const int64_t per = 6 / world;
  std::vector<fsdp::Shard> shards{
      {full.narrow(0, rank * per, per).clone(), ShardMetadata{{rank * per, 0}, {per, 5}, rank}}};
  StateDict model;
  model.insert_or_assign("w", ShardedTensor({6, 5}, at::kFloat, std::move(shards)));
  model.insert_or_assign("b", at::tensor({0.5, -1.0, 2.0}).to(at::kBFloat16));
  model.insert_or_assign("steps", at::tensor({1, 2, 3}, at::kLong));
  model.insert_or_assign("scale", at::scalar_tensor(2.5, at::kDouble));
  model.insert_or_assign("empty", at::zeros({0, 3}));
  StateDict optim;
  optim.insert_or_assign("exp_avg", at::ones({4}));
  StateDict sd;
  sd.insert_or_assign("model", model);
  sd.insert_or_assign("optim", optim);
  return sd;
}

StateDict expected_model() {
  StateDict m;
  m.insert_or_assign("w", at::arange(30, at::kFloat).reshape({6, 5}) / 4);
  m.insert_or_assign("b", at::tensor({0.5, -1.0, 2.0}).to(at::kBFloat16));
  m.insert_or_assign("steps", at::tensor({1, 2, 3}, at::kLong));
  m.insert_or_assign("scale", at::scalar_tensor(2.5, at::kDouble));
  m.insert_or_assign("empty", at::zeros({0, 3}));
  return m;
}

class CheckpointExport : public ::testing::Test {
 protected:
  void SetUp() override {
    run_ranks(2, [&](ProcessGroup& pg) { ckpt::save(model_sample(pg.rank(), 2), tmp.file("c")); });
  }
  TempDir tmp;
};

TEST_F(CheckpointExport, SafetensorsOneFileAndSplitRoundTrip) {
  const std::string want = tensor_lines(expected_model());
  run_ranks(1, [&](ProcessGroup&) {
    const auto one = ckpt::export_safetensors(tmp.file("c"), tmp.file("st1"));
    ASSERT_EQ(one, std::vector<std::string>{tmp.file("st1") + "/model.safetensors"});
    EXPECT_EQ(tensor_lines(ckpt::load_safetensors(tmp.file("st1"))), want);
    // Split: w (120 bytes) alone, then the small ones together.
    const auto split = ckpt::export_safetensors(tmp.file("c"), tmp.file("st2"),
                                                ckpt::ExportOptions().max_shard_bytes(64));
    ASSERT_GE(split.size(), 3u);
    EXPECT_EQ(split.back(), tmp.file("st2") + "/model.safetensors.index.json");
    EXPECT_NE(split[0].find("model-00001-of-"), std::string::npos) << split[0];
    EXPECT_EQ(tensor_lines(ckpt::load_safetensors(tmp.file("st2"))), want);
    // The negative control: a different tensor changes the lines.
    StateDict other = expected_model();
    other.at("w").tensor()[5][4] = 0;
    EXPECT_NE(tensor_lines(other), want);
    // From memory, with the prefix "" and a full key set.
    ckpt::save_safetensors(expected_model(), tmp.file("st3"), ckpt::ExportOptions().prefix(""));
    EXPECT_EQ(tensor_lines(ckpt::load_safetensors(tmp.file("st3") + "/model.safetensors")), want);
    // A prefix that matches nothing is an error, as is a ShardedTensor in memory.
    EXPECT_NE(error_of([&] {
                ckpt::export_safetensors(tmp.file("c"), tmp.file("x"),
                                         ckpt::ExportOptions().prefix("nope."));
              }).find("no tensor under the prefix 'nope.'"),
              std::string::npos);
    StateDict sharded = model_sample(0, 1);
    EXPECT_NE(
        error_of([&] { ckpt::save_safetensors(sharded, tmp.file("x")); }).find("ShardedTensor"),
        std::string::npos);
  });
}

// Without a prefix the layout decides: a {model, optim} checkpoint (the fixture's) exports its
// model under the parameters' own names, and so does one that holds only "model"; a plain model
// state dict, as `dcp.save(get_model_state_dict(model))` writes it, exports every tensor under its
// key, as does one where "model." is only part of the names (a Hugging Face "model.*" beside
// "lm_head"). Before, the plain one failed ("no tensor under the prefix 'model.'").
TEST_F(CheckpointExport, DefaultPrefixFollowsTheLayout) {
  const StateDict model = expected_model();
  const std::string want = tensor_lines(model);
  StateDict only_model;
  only_model.insert_or_assign("model", model);
  StateDict hf = only_model;
  hf.insert_or_assign("lm_head", at::full({2}, 0.25));
  StateDict hf_flat;
  for (const auto& [k, v] : model) hf_flat.insert_or_assign("model." + k, v);
  hf_flat.insert_or_assign("lm_head", at::full({2}, 0.25));
  run_ranks(1, [&](ProcessGroup&) {
    ckpt::export_pt(tmp.file("c"), tmp.file("c.pt"));
    EXPECT_EQ(tensor_lines(ckpt::load_pt(tmp.file("c.pt"))), want);
    ckpt::save(model, tmp.file("plain"));
    ckpt::export_pt(tmp.file("plain"), tmp.file("plain.pt"));
    EXPECT_EQ(tensor_lines(ckpt::load_pt(tmp.file("plain.pt"))), want);
    ckpt::export_safetensors(tmp.file("plain"), tmp.file("plain_st"));
    EXPECT_EQ(tensor_lines(ckpt::load_safetensors(tmp.file("plain_st"))), want);
    ckpt::save(only_model, tmp.file("only"));
    ckpt::export_pt(tmp.file("only"), tmp.file("only.pt"));
    EXPECT_EQ(tensor_lines(ckpt::load_pt(tmp.file("only.pt"))), want);
    ckpt::save(hf, tmp.file("hf"));
    ckpt::export_pt(tmp.file("hf"), tmp.file("hf.pt"));
    EXPECT_EQ(tensor_lines(ckpt::load_pt(tmp.file("hf.pt"))), tensor_lines(hf_flat));
    // From memory the same rules apply.
    ckpt::save_pt(model, tmp.file("mem.pt"));
    EXPECT_EQ(tensor_lines(ckpt::load_pt(tmp.file("mem.pt"))), want);
    ckpt::save_pt(hf, tmp.file("mem_hf.pt"));
    EXPECT_EQ(tensor_lines(ckpt::load_pt(tmp.file("mem_hf.pt"))), tensor_lines(hf_flat));
    // The negative control: asking for "model." on the plain checkpoint still fails, naming it.
    EXPECT_NE(error_of([&] {
                ckpt::export_pt(tmp.file("plain"), tmp.file("x.pt"),
                                ckpt::ExportOptions().prefix("model."));
              }).find("no tensor under the prefix 'model.'"),
              std::string::npos);
  });
}

TEST_F(CheckpointExport, PythonSafetensorsReadsOurExports) {
  if (!has_safetensors()) GTEST_SKIP() << "no Python safetensors here (the trixie chroot has it)";
  run_ranks(1, [&](ProcessGroup&) {
    ckpt::export_safetensors(tmp.file("c"), tmp.file("st1"));
    ckpt::export_safetensors(tmp.file("c"), tmp.file("st2"),
                             ckpt::ExportOptions().max_shard_bytes(64));
  });
  const std::string want = tensor_lines(expected_model());
  EXPECT_EQ(py("st_read " + tmp.file("st1") + "/model.safetensors"), want);
  EXPECT_EQ(py("st_read " + tmp.file("st2") + "/model.safetensors.index.json"), want);
}

TEST_F(CheckpointExport, PtRoundTripAndTorchLoadWeightsOnly) {
  const std::string want = tensor_lines(expected_model());
  run_ranks(1, [&](ProcessGroup&) {
    ckpt::export_pt(tmp.file("c"), tmp.file("m.pt"));
    EXPECT_EQ(tensor_lines(ckpt::load_pt(tmp.file("m.pt"))), want);
    ckpt::save_pt(expected_model(), tmp.file("m2.pt"), ckpt::ExportOptions().prefix(""));
    EXPECT_EQ(tensor_lines(ckpt::load_pt(tmp.file("m2.pt"))), want);
  });
  if (kPython.empty()) GTEST_SKIP() << "no Python with torch here";
  EXPECT_EQ(py("pt_read " + tmp.file("m.pt")), want);
}

// Python-written files: torch.save(module-style OrderedDict with shared storages and a strided
// view), and safetensors.torch.save_file of the same tensors.
TEST_F(CheckpointExport, PythonWrittenPtImport) {
  if (kPython.empty()) GTEST_SKIP() << "no Python with torch here";
  const std::string want = py("pt_write " + tmp.file("py.pt"));
  ASSERT_NE(want.find("view float32 3,2 1.0,2.0,5.0,6.0,9.0,10.0"), std::string::npos) << want;
  run_ranks(
      1, [&](ProcessGroup&) { EXPECT_EQ(tensor_lines(ckpt::load_pt(tmp.file("py.pt"))), want); });
}

TEST_F(CheckpointExport, PythonWrittenSafetensorsImport) {
  if (!has_safetensors()) GTEST_SKIP() << "no Python safetensors here (the trixie chroot has it)";
  const std::string st = py("st_write " + tmp.file("py.safetensors"));
  ASSERT_NE(st.find("view float32 3,2 1.0,2.0,5.0,6.0,9.0,10.0"), std::string::npos) << st;
  run_ranks(1, [&](ProcessGroup&) {
    EXPECT_EQ(tensor_lines(ckpt::load_safetensors(tmp.file("py.safetensors"))), st);
  });
}

// An empty tensor at [0, 0] beside one at [0, 4], the empty one's name sorting last: what
// Python's save_file writes for a shard holding both (found by the safetensors_files fuzz seed
// from transformers' sharded layout). The reference reader orders tensors by (begin, end) and
// accepts it; ordered by begin alone, we refused it as "overlaps another or leaves a gap".
TEST_F(CheckpointExport, AnEmptyTensorAtTheOffsetOfAnotherIsRead) {
  const std::string header = R"({"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]},)"
                             R"("z":{"dtype":"F32","shape":[0,2],"data_offsets":[0,0]}})";
  std::string file(8, '\0');
  for (int k = 0; k < 8; ++k) file[k] = static_cast<char>((header.size() >> (8 * k)) & 0xff);
  file += header + std::string("\x80\x3f\x00\x40", 4);  // bf16 1.0, 2.0
  write_bytes(tmp.file("empty_first.safetensors"), file);
  run_ranks(1, [&](ProcessGroup&) {
    const fsdp::StateDict sd = ckpt::load_safetensors(tmp.file("empty_first.safetensors"));
    ASSERT_EQ(sd.size(), 2u);
    EXPECT_TRUE(sd.at("a").tensor().equal(at::tensor({1.0, 2.0}).to(at::kBFloat16)));
    EXPECT_EQ(sd.at("z").tensor().sizes(), (std::vector<int64_t>{0, 2}));
  });
}

// Streaming: exporting a checkpoint of 8 tensors of 64 KiB holds about one of them at a time.
TEST_F(CheckpointExport, ExportStreamsOneTensorAtATime) {
  run_ranks(2, [&](ProcessGroup& pg) {
    StateDict model;
    for (int i = 0; i < 8; ++i) {
      const at::Tensor full = fsdp::testing::seeded_randn({128, 128}, 100 + i);
      model.insert_or_assign(
          "t" + std::to_string(i),
          ShardedTensor({128, 128}, at::kFloat,
                        {{full.narrow(0, pg.rank() * 64, 64).clone(),
                          ShardMetadata{{pg.rank() * 64, 0}, {64, 128}, pg.rank()}}}));
    }
    StateDict sd;
    sd.insert_or_assign("model", model);
    ckpt::save(sd, tmp.file("big"));
  });
  run_ranks(1, [&](ProcessGroup&) {
    const int64_t one = 128 * 128 * 4;
    for (const std::string kind : {"safetensors", "pt"}) {
      int64_t peak = 0;
      {
        fsdp::testing::MemoryWatch watch;
        if (kind == "pt") {
          ckpt::export_pt(tmp.file("big"), tmp.file("big.pt"));
        } else {
          ckpt::export_safetensors(tmp.file("big"), tmp.file("big_st"));
        }
        peak = watch.peak();
      }
      // One tensor assembled, the chunks decoded into it and the coverage mask: about 3.3 x one
      // tensor, against 8 x for the whole model.
      EXPECT_LE(peak, 4 * one) << kind << ": peak " << peak << " bytes, one tensor " << one;
      EXPECT_GE(peak, one) << kind << ": the watch saw the tensor being assembled";
    }
    const StateDict st = ckpt::load_safetensors(tmp.file("big_st"));
    const StateDict pt = ckpt::load_pt(tmp.file("big.pt"));
    for (int i = 0; i < 8; ++i) {
      const at::Tensor want = fsdp::testing::seeded_randn({128, 128}, 100 + i);
      EXPECT_TRUE(at::equal(st.at("t" + std::to_string(i)).tensor(), want));
      EXPECT_TRUE(at::equal(pt.at("t" + std::to_string(i)).tensor(), want));
    }
  });
}

// Damaged and hostile files: errors naming the file and the problem, never a crash or a large
// allocation.
TEST_F(CheckpointExport, HostileFilesAreErrors) {
  run_ranks(1, [&](ProcessGroup&) {
    ckpt::save_safetensors(expected_model(), tmp.file("st"), ckpt::ExportOptions().prefix(""));
    ckpt::save_pt(expected_model(), tmp.file("m.pt"), ckpt::ExportOptions().prefix(""));
    const std::string st_path = tmp.file("st") + "/model.safetensors";
    const std::string st = read_bytes(st_path);
    const std::string pt = read_bytes(tmp.file("m.pt"));
    uint64_t hlen = 0;
    for (int k = 7; k >= 0; --k) hlen = (hlen << 8) | static_cast<unsigned char>(st[k]);
    const std::string header = st.substr(8, hlen);
    auto file_of = [](std::string h, const std::string& data) {
      h.append((8 - h.size() % 8) % 8, ' ');
      std::string out(8, '\0');
      for (int k = 0; k < 8; ++k) out[k] = static_cast<char>((h.size() >> (8 * k)) & 0xff);
      return out + h + data;
    };
    auto with_header = [&](std::string h) { return file_of(std::move(h), st.substr(8 + hlen)); };
    // One float each, every tensor's own offsets in range: only how they tile the data is wrong.
    auto floats_at = [&](const std::vector<std::pair<int, int>>& offsets, size_t data_bytes) {
      std::string h = "{";
      for (size_t i = 0; i < offsets.size(); ++i)
        h += std::string(i ? "," : "") + "\"t" + std::to_string(i) +
             "\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[" +
             std::to_string(offsets[i].first) + "," + std::to_string(offsets[i].second) + "]}";
      return file_of(h + "}", std::string(data_bytes, '\0'));
    };
    auto replaced = [&](const std::string& from, const std::string& to) {
      std::string h = header;
      const size_t at = h.find(from);
      EXPECT_NE(at, std::string::npos) << from;
      return with_header(h.replace(at, from.size(), to));
    };
    struct Case {
      const char* name;
      std::string bytes;
      const char* expected;
    };
    std::string huge_len = st;
    huge_len[6] = '\x7f';
    const std::vector<Case> st_cases = {
        {"empty", "", "shorter than"},
        {"header length beyond the file", huge_len, "header length"},
        {"header not JSON", with_header("{\"w\": "), "not valid JSON"},
        // nlohmann's parser stops at a NUL: without our check this header parsed (issue 39).
        {"header with a NUL and garbage after it",
         with_header(header + std::string("\0garbage", 8)), "a NUL byte at offset"},
        {"unknown dtype", replaced("\"F32\"", "\"F99\""), "unsupported dtype 'F99'"},
        {"negative dimension", replaced("[6,5]", "[-6,5]"), "bad shape"},
        {"offsets past the data", replaced("\"data_offsets\":[0,", "\"data_offsets\":[99999,"),
         "data_offsets"},
        {"truncated data", st.substr(0, st.size() - 5), "data_offsets"},
        {"overflowing shape", replaced("[6,5]", "[4611686018427387904,4]"), "overflows"},
        // safetensors' own reader refuses these too: tensors must tile the data exactly.
        {"two tensors on the same bytes", floats_at({{0, 4}, {0, 4}}, 8),
         "overlaps another or leaves a gap"},
        {"bytes before the first tensor", floats_at({{4, 8}}, 8),
         "overlaps another or leaves a gap"},
        {"bytes after the last tensor", floats_at({{0, 4}}, 8), "bytes no tensor covers"},
    };
    for (const Case& c : st_cases) {
      fsdp::testing::keep_as_fuzz_regression("safetensors", c.name, c.bytes);
      write_bytes(tmp.file("bad.safetensors"), c.bytes);
      std::string err;
      int64_t peak = 0;
      {
        fsdp::testing::MemoryWatch watch;
        err = error_of([&] { ckpt::load_safetensors(tmp.file("bad.safetensors")); });
        peak = watch.peak();
      }
      EXPECT_NE(err.find(c.expected), std::string::npos) << c.name << ": " << err;
      EXPECT_NE(err.find("bad.safetensors"), std::string::npos) << c.name << ": " << err;
      EXPECT_LT(peak, 4096) << c.name;
    }
    // An index whose weight_map names anything but a file beside it: a path, a Windows path, the
    // directory itself or its parent, an empty name, a NUL inside a name.
    ::mkdir(tmp.file("idx").c_str(), 0755);
    const std::string idx = tmp.file("idx") + "/model.safetensors.index.json";
    for (const std::string& f :
         {std::string("../st/model.safetensors"), std::string("sub/model.safetensors"),
          std::string("..\\\\st\\\\model.safetensors"), std::string(".."), std::string("."),
          std::string(""), std::string("model.safetensors\\u0000x")}) {
      write_bytes(idx, "{\"metadata\": {}, \"weight_map\": {\"w\": \"" + f + "\"}}");
      fsdp::testing::keep_as_fuzz_regression("safetensors_files", "index naming " + f,
                                             "st/model.safetensors.index.json\n" + read_bytes(idx) +
                                                 fsdp::fuzz::kFileSeparator +
                                                 "st/model.safetensors\n" + st);
      const std::string err = error_of([&] { ckpt::load_safetensors(tmp.file("idx")); });
      EXPECT_NE(err.find("not a file beside the index"), std::string::npos) << f << ": " << err;
      EXPECT_NE(err.find("model.safetensors.index.json"), std::string::npos) << f << ": " << err;
    }
    // The negative control: the same index naming a plain file beside it is read (and here finds
    // the file missing, a different error).
    write_bytes(idx, "{\"metadata\": {}, \"weight_map\": {\"w\": \"model.safetensors\"}}");
    EXPECT_EQ(error_of([&] {
                ckpt::load_safetensors(tmp.file("idx"));
              }).find("not a file beside the index"),
              std::string::npos);
    // .pt: garbage, truncated, a TorchScript archive (torch::save), a pickle that calls
    // os.system, a flipped byte in a storage, a directory outside the file.
    std::string os_system;
    {
      caffe2::serialize::PyTorchStreamWriter w([&](const void* d, size_t n) {
        os_system.append(static_cast<const char*>(d), n);
        return n;
      });
      const std::string pkl(
          "\x80\x02"
          "cos\nsystem\nX\x02\x00\x00\x00"
          "id\x85R.",
          23);
      w.writeRecord("data.pkl", pkl.data(), pkl.size());
      w.writeEndOfFile();
    }
    // A list nested a million deep (a million EMPTY_LISTs, then APPENDs): within every limit of
    // the reader, and it used to overflow the stack when the parsed tree was destroyed (issue 39).
    std::string deep;
    {
      caffe2::serialize::PyTorchStreamWriter w([&](const void* d, size_t n) {
        deep.append(static_cast<const char*>(d), n);
        return n;
      });
      const size_t n = 1000000;
      const std::string pkl = "\x80\x02" + std::string(n, ']') + std::string(n - 1, 'a') + ".";
      w.writeRecord("data.pkl", pkl.data(), pkl.size());
      w.writeEndOfFile();
    }
    torch::save(at::ones({2}), tmp.file("script.pt"));
    // A byte of the first storage flipped: only its CRC-32 can tell (a .pt has no other check).
    std::string flipped = pt;
    {
      const size_t name = flipped.find("/data/0");
      const size_t local = flipped.rfind(std::string("PK\x03\x04", 4), name);
      ASSERT_NE(name, std::string::npos);
      ASSERT_NE(local, std::string::npos);
      auto u16 = [&](size_t at) {
        return static_cast<size_t>(static_cast<unsigned char>(flipped[at])) |
               static_cast<size_t>(static_cast<unsigned char>(flipped[at + 1])) << 8;
      };
      flipped[local + 30 + u16(local + 26) + u16(local + 28)] ^= 0x01;
    }
    // The directory's offset pointed past the end of the file.
    std::string far = pt;
    far.replace(far.rfind(std::string("PK\x05\x06", 4)) + 16, 4,
                std::string("\xf0\xff\xff\x7f", 4));
    const std::vector<std::pair<std::string, const char*>> pt_cases = {
        {std::string(100, 'x'), "not a torch.save archive"},
        {pt.substr(0, pt.size() / 2), "not a torch.save archive"},
        {read_bytes(tmp.file("script.pt")), "TorchScript"},
        {os_system, "os.system"},
        {flipped, "fails its CRC-32"},
        {far, "its directory lies outside the file"},
        {deep, "holds a list, not a dict"},
    };
    int pt_case = 0;
    for (const auto& [bytes, expected] : pt_cases) {
      fsdp::testing::keep_as_fuzz_regression(
          "load_pt", "case" + std::to_string(pt_case++) + " " + expected, bytes);
      write_bytes(tmp.file("bad.pt"), bytes);
      const std::string err = error_of([&] { ckpt::load_pt(tmp.file("bad.pt")); });
      EXPECT_NE(err.find(expected), std::string::npos) << err;
      EXPECT_NE(err.find("bad.pt"), std::string::npos) << err;
    }
  });
}

}  // namespace

// The torch.save archives a save writes per tensor (our own zip writer and CRC-32) read back
// bit-exactly through LibTorch's own archive reader and through ours, for every dtype and for
// 0-d, empty, 3-D, non-contiguous and offset views; data/0 is 64-byte aligned as in torch.save.
TEST(TorchArchive, OurTensorItemsReadBackThroughLibTorchAndOurReader) {
  namespace items = fsdp::checkpoint::items;
  namespace archive = fsdp::checkpoint::archive;
  // The zip CRC-32 check value, and continuing a CRC over two pieces.
  EXPECT_EQ(archive::crc32("123456789", 9), 0xCBF43926u);
  EXPECT_EQ(archive::crc32("6789", 4, archive::crc32("12345", 5)), 0xCBF43926u);
  const at::Tensor base = at::arange(0, 60, at::kDouble).reshape({3, 4, 5});
  std::vector<at::Tensor> cases;
  for (auto dt : {at::kDouble, at::kFloat, at::kHalf, at::kBFloat16, at::kLong, at::kInt,
                  at::kShort, at::kChar, at::kByte, at::kBool})
    cases.push_back(base.to(dt));
  cases.push_back(at::tensor(3.5));                                      // 0-d
  cases.push_back(at::empty({0, 7}));                                    // empty
  cases.push_back(base.to(at::kFloat).transpose(0, 2));                  // non-contiguous
  cases.push_back(base.to(at::kFloat).reshape({-1}).narrow(0, 13, 20));  // offset view
  for (const at::Tensor& t : cases) {
    SCOPED_TRACE(std::string(c10::toString(t.scalar_type())) + " " + c10::str(t.sizes()));
    std::vector<char> bytes;
    items::write_tensor_item(t,
                             [&](const char* d, size_t n) { bytes.insert(bytes.end(), d, d + n); });
    const at::Tensor theirs = torch::pickle_load(bytes).toTensor();
    EXPECT_TRUE(theirs.equal(t));
    EXPECT_EQ(theirs.sizes(), t.sizes());
    const at::Tensor ours = items::decode_tensor(bytes.data(), bytes.size(), "case", true);
    EXPECT_TRUE(ours.equal(t));
    archive::Directory dir(
        static_cast<int64_t>(bytes.size()),
        [&](int64_t off, size_t n, char* dst) { std::memcpy(dst, bytes.data() + off, n); }, "case");
    ASSERT_NE(dir.find("data/0"), nullptr);
    EXPECT_EQ(dir.find("data/0")->offset % 64, 0);
    // Negative control: a flipped data byte fails the CRC-32 check.
    if (t.numel() > 0) {
      std::vector<char> bad = bytes;
      bad[dir.find("data/0")->offset] ^= 0x5a;
      EXPECT_THROW(items::decode_tensor(bad.data(), bad.size(), "case", true), fsdp::ValueError);
    }
  }
}
