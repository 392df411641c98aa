// fsdp-ckpt: look into, check, convert and compare checkpoints (issue 11).
//
//   fsdp-ckpt inspect DIR                 keys, dtypes, shapes, bytes, who saved it
//   fsdp-ckpt verify DIR                  every checksum, chunk coverage, every item decodes
//   fsdp-ckpt convert SRC DST --to FMT    checkpoint -> safetensors | pt, and files -> dcp
//   fsdp-ckpt diff A B [--rtol --atol]    two checkpoints or exports, tensor by tensor
//   fsdp-ckpt assemble OUT DIR...         a node-local save's per-host directories -> one
//
// Exit status: 0 fine, 1 verification or diff found a difference, 2 bad usage or an error. Every
// error is one line on stderr; nothing here may crash or die on a signal.
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <cmath>
#include <cstdio>
#include <ctime>
#include <iostream>
#include <optional>
#include <sstream>
#include <vector>

#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/checkpoint/export.h"
#include "fsdp/errors.h"

namespace ckpt = fsdp::checkpoint;

namespace {

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

std::string dims(const std::vector<int64_t>& v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
  return out + "]";
}

std::string human(int64_t b) {
  char buf[32];
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double x = static_cast<double>(b);
  int u = 0;
  while (x >= 1024 && u < 4) x /= 1024, ++u;
  std::snprintf(buf, sizeof buf, u ? "%.1f %s" : "%.0f %s", x, units[u]);
  return buf;
}

// A progress bar on stderr, only when it is a terminal and the work is long enough to matter.
void progress(int64_t done, int64_t total) {
  if (!::isatty(2) || total < 50) return;
  const int width = 40;
  const int filled = static_cast<int>(width * done / std::max<int64_t>(total, 1));
  std::fprintf(stderr, "\r[%s%s] %lld/%lld", std::string(filled, '#').c_str(),
               std::string(width - filled, ' ').c_str(), static_cast<long long>(done),
               static_cast<long long>(total));
  if (done == total) std::fprintf(stderr, "\n");
}

// A double with all the digits that tell it apart (std::to_string would print 1e-7 as 0.000000).
std::string shortest(double x) {
  std::ostringstream out;
  out.precision(9);
  out << x;
  return out.str();
}

// PyTorch's names ("float32"), which is what Python users read in their own tools.
std::string dtype_name(at::ScalarType t) {
  const at::ScalarType known[] = {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kLong,
                                  at::kInt,   at::kShort,  at::kChar, at::kByte,     at::kBool};
  const char* names[] = {"float32", "float64", "float16", "bfloat16", "int64",
                         "int32",   "int16",   "int8",    "uint8",    "bool"};
  for (size_t i = 0; i < sizeof known / sizeof known[0]; ++i)
    if (known[i] == t) return names[i];
  return c10::toString(t);
}

bool is_dir(const std::string& p) { return ckpt::default_file_io().is_dir(p) == 1; }

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The tensors of a checkpoint directory, a safetensors file / index / directory, or a .pt file,
// as a flat dict (checkpoints keep their DCP keys; values are left out).
fsdp::StateDict tensors_of(const std::string& path) {
  fsdp::StateDict out;
  if (is_dir(path) && ckpt::default_file_io().file_size(path + "/.metadata") >= 0) {
    fsdp::StateDict t = ckpt::full_template(ckpt::inspect(path));
    ckpt::load(t, path);
    for (auto& [k, v] : t)
      if (v.is_tensor()) out.insert_or_assign(k, v);
    return out;
  }
  if (ends_with(path, ".pt") || ends_with(path, ".pth") || ends_with(path, ".bin")) {
    fsdp::StateDict sd = ckpt::load_pt(path);
    std::function<void(const fsdp::StateValue&, const std::string&)> go =
        [&](const fsdp::StateValue& v, const std::string& k) {
          if (v.is_tensor()) out.insert_or_assign(k, v);
          if (v.is_dict())
            for (const auto& [kk, x] : v.dict()) go(x, k.empty() ? kk : k + "." + kk);
        };
    go(fsdp::StateValue(sd), "");
    return out;
  }
  return ckpt::load_safetensors(path);
}

// When a checkpoint was saved, from its manifest's created_unix, as "2026-11-26 07:30:00 UTC". The
// manifest is not checksummed: a time gmtime cannot represent (a year past 2^31) is printed as the
// number it is, never handed to strftime as a null tm.
std::string saved_when(int64_t created_unix) {
  const auto t = static_cast<std::time_t>(created_unix);
  std::tm tm{};
  char when[64];
  if (::gmtime_r(&t, &tm) == nullptr ||
      std::strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S UTC", &tm) == 0) {
    return "created_unix " + std::to_string(created_unix) + " (not a representable time)";
  }
  return when;
}

int cmd_inspect(const std::string& dir) {
  const ckpt::CheckpointInfo info = ckpt::inspect(dir);
  std::cout << "checkpoint " << dir << "\n";
  if (info.has_manifest) {
    std::cout << "  format version " << info.format_version << ", saved by " << info.world_size
              << " rank(s) with fsdp-cpp " << info.library_version << " (LibTorch "
              << info.torch_version << ") at " << saved_when(info.created_unix) << "\n";
    for (const auto& [k, v] : info.annotations) std::cout << "  " << k << ": " << v << "\n";
  } else {
    std::cout << "  no manifest: written by PyTorch DCP (or another tool); not verifiable\n";
  }
  int64_t total = 0, tensors = 0;
  for (const auto& e : info.entries) {
    total += e.stored_bytes;
    tensors += e.tensor;
  }
  std::cout << "  " << info.entries.size() << " keys (" << tensors << " tensors), "
            << info.files.size() << " data file(s), " << human(total) << " stored\n";
  for (const auto& e : info.entries) {
    if (e.tensor) {
      std::cout << "  " << e.key << "  " << dtype_name(e.dtype) << " " << dims(e.shape) << "  "
                << e.chunks << " chunk(s), " << human(e.stored_bytes) << "\n";
    } else {
      std::cout << "  " << e.key << "  value, " << human(e.stored_bytes) << "\n";
    }
  }
  return 0;
}

int cmd_verify(const std::string& dir) {
  const ckpt::VerifyReport rep = ckpt::verify(dir, nullptr, progress);
  for (const auto& p : rep.problems) std::cerr << "fsdp-ckpt: " << first_line(p) << "\n";
  if (!rep.ok()) return 1;
  std::cout << "ok: " << dir << ": " << rep.items << " items, " << human(rep.bytes)
            << " checked against their xxh3 checksums (format version " << rep.format_version
            << ", saved by " << rep.world_size << " rank(s))\n";
  if (!rep.elsewhere.empty()) {
    std::cout << "  a node-local save: " << rep.elsewhere.size()
              << " data file(s) are in other hosts' directories, not checked here:";
    for (const auto& f : rep.elsewhere) std::cout << " " << f;
    std::cout << "\n";
  }
  return 0;
}

// `given`: --prefix, if set. Unset, an export takes the checkpoint's layout (ExportOptions::prefix)
// and an import puts the tensors under "model.", where fsdp-train looks for them.
int cmd_convert(const std::string& src, const std::string& dst, const std::string& to,
                const std::optional<std::string>& given, int64_t max_shard) {
  const auto opts = ckpt::ExportOptions().prefix(given).max_shard_bytes(max_shard);
  if (to == "safetensors") {
    for (const auto& f : ckpt::export_safetensors(src, dst, opts))
      std::cout << "wrote " << f << "\n";
  } else if (to == "pt") {
    ckpt::export_pt(src, dst, opts);
    std::cout << "wrote " << dst << "\n";
  } else {  // dcp: tensors from a safetensors or .pt export, under `prefix` again
    fsdp::StateDict sd = tensors_of(src);
    const size_t n = sd.size();
    std::string top = given.value_or("model.");
    if (!top.empty() && top.back() == '.') top.pop_back();
    if (!top.empty()) {
      fsdp::StateDict outer;
      outer.insert_or_assign(top, std::move(sd));
      sd = std::move(outer);
    }
    ckpt::save(sd, dst);
    std::cout << "wrote checkpoint " << dst << " (" << n << " tensors)\n";
  }
  return 0;
}

int cmd_diff(const std::string& a_path, const std::string& b_path, double rtol, double atol,
             const std::string& strip_a, const std::string& strip_b) {
  auto strip = [](const fsdp::StateDict& sd, const std::string& prefix) {
    fsdp::StateDict out;
    for (const auto& [k, v] : sd)
      if (prefix.empty() || k.compare(0, prefix.size(), prefix) == 0)
        out.insert_or_assign(k.substr(prefix.size()), v);
    return out;
  };
  const fsdp::StateDict a = strip(tensors_of(a_path), strip_a);
  const fsdp::StateDict b = strip(tensors_of(b_path), strip_b);
  int differences = 0;
  double largest = 0;
  std::string largest_key;
  auto report = [&](const std::string& line) {
    std::cout << line << "\n";
    ++differences;
  };
  for (const auto& [k, v] : a)
    if (!b.contains(k)) report("only in " + a_path + ": " + k);
  for (const auto& [k, v] : b)
    if (!a.contains(k)) report("only in " + b_path + ": " + k);
  for (const auto& [k, va] : a) {
    if (!b.contains(k)) continue;
    const at::Tensor x = va.tensor(), y = b.at(k).tensor();
    if (x.scalar_type() != y.scalar_type() || x.sizes() != y.sizes()) {
      report(k + ": " + dtype_name(x.scalar_type()) + " " + dims(x.sizes().vec()) + " vs " +
             dtype_name(y.scalar_type()) + " " + dims(y.sizes().vec()));
      continue;
    }
    const at::Tensor xd = x.to(at::kDouble), yd = y.to(at::kDouble);
    const at::Tensor bad = ((xd - yd).abs() > atol + rtol * yd.abs()) | (xd.isnan() != yd.isnan());
    const int64_t n = bad.sum().item<int64_t>();
    const double worst = x.numel() ? (xd - yd).abs().nan_to_num(0).max().item<double>() : 0.0;
    if (largest_key.empty() || worst > largest) largest = worst, largest_key = k;
    if (n > 0)
      report(k + ": " + std::to_string(n) + " of " + std::to_string(x.numel()) +
             " elements differ (max abs difference " + shortest(worst) + ")");
  }
  // One figure for scripts that compare runs (scripts/chaos.py): the largest difference anywhere.
  if (!largest_key.empty())
    std::cout << "largest abs difference: " << shortest(largest) << " (" << largest_key << ")\n";
  if (differences == 0)
    std::cout << "same: " << a.size() << " tensors equal within rtol " << rtol << ", atol " << atol
              << "\n";
  return differences == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "fsdp-ckpt: inspect, verify, convert and compare fsdp-cpp / PyTorch DCP checkpoints"};
  app.require_subcommand(1);
  std::string dir, src, dst, to = "safetensors", prefix, a, b, strip_a, strip_b;
  int64_t max_shard = 0;
  double rtol = 0, atol = 0;
  auto* inspect = app.add_subcommand("inspect",
                                     "List a checkpoint's keys, dtypes, shapes and sizes, "
                                     "and who saved it");
  inspect->add_option("dir", dir, "checkpoint directory")->required();
  auto* verify = app.add_subcommand(
      "verify",
      "Check every byte against the manifest's checksums, chunk coverage and decoding; "
      "exit 1 naming the file and key on failure");
  verify->add_option("dir", dir, "checkpoint directory")->required();
  auto* convert = app.add_subcommand(
      "convert",
      "Checkpoint to safetensors (a directory) or .pt; safetensors or .pt to a checkpoint");
  convert->add_option("src", src, "checkpoint directory, safetensors file/directory or .pt file")
      ->required();
  convert->add_option("dst", dst, "output directory (safetensors, dcp) or file (pt)")->required();
  convert->add_option("--to", to, "safetensors, pt or dcp")
      ->check(CLI::IsMember({"safetensors", "pt", "dcp"}))
      ->capture_default_str();
  auto* prefix_opt = convert->add_option(
      "--prefix", prefix,
      "checkpoint keys to export (stripped from the names; default: 'model.' for a {model, optim} "
      "checkpoint, every tensor of any other), or the key to put imported tensors under "
      "(default: model.)");
  convert->add_option("--max-shard-bytes", max_shard,
                      "safetensors: split into files of at most this many bytes (0: one file)");
  auto* diff = app.add_subcommand("diff",
                                  "Compare the tensors of two checkpoints or exports; exit 1 "
                                  "if they differ");
  diff->add_option("a", a, "checkpoint directory, safetensors or .pt")->required();
  diff->add_option("b", b, "checkpoint directory, safetensors or .pt")->required();
  diff->add_option("--rtol", rtol, "relative tolerance")->capture_default_str();
  diff->add_option("--atol", atol, "absolute tolerance")->capture_default_str();
  diff->add_option("--strip-a", strip_a, "drop this prefix from A's keys (e.g. model.)");
  diff->add_option("--strip-b", strip_b, "drop this prefix from B's keys");
  std::vector<std::string> host_dirs;
  auto* assemble = app.add_subcommand(
      "assemble",
      "Gather the per-host directories of a node-local save (--node-local) into one ordinary "
      "checkpoint directory, verified, that stock dcp.load reads");
  assemble->add_option("out", dst, "the checkpoint directory to create")->required();
  assemble->add_option("dirs", host_dirs, "each host's directory of the checkpoint")->required();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  try {
    if (*inspect) return cmd_inspect(dir);
    if (*verify) return cmd_verify(dir);
    if (*convert) {
      const std::optional<std::string> given =
          prefix_opt->count() > 0 ? std::optional<std::string>(prefix) : std::nullopt;
      return cmd_convert(src, dst, to, given, max_shard);
    }
    if (*diff) return cmd_diff(a, b, rtol, atol, strip_a, strip_b);
    if (*assemble) {
      ckpt::assemble(host_dirs, dst);
      std::cout << "ok: " << dst << " assembled from " << host_dirs.size()
                << " directories and verified\n";
      return 0;
    }
  } catch (const std::exception& e) {
    std::cerr << "fsdp-ckpt: " << first_line(e.what()) << "\n";
    return 2;
  } catch (...) {
    std::cerr << "fsdp-ckpt: unknown error\n";
    return 2;
  }
  return 2;
}
