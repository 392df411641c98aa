// fsdp-ckpt's commands (tools/ckpt_commands.h). The public API only, like any user.
#include "ckpt_commands.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <functional>
#include <sstream>

#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/checkpoint/export.h"
#include "fsdp/errors.h"

namespace fsdp_ckpt {
namespace {

namespace ckpt = fsdp::checkpoint;

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
void progress_bar(int64_t done, int64_t total) {
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

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
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

fsdp::StateDict strip(const fsdp::StateDict& sd, const std::string& prefix) {
  fsdp::StateDict out;
  for (const auto& [k, v] : sd)
    if (prefix.empty() || k.compare(0, prefix.size(), prefix) == 0)
      out.insert_or_assign(k.substr(prefix.size()), v);
  return out;
}

}  // namespace

fsdp::StateDict tensors_of(const std::string& path, FileIO& io) {
  fsdp::StateDict out;
  if (io.is_dir(path) == 1 && io.file_size(path + "/.metadata") >= 0) {
    fsdp::StateDict t = ckpt::full_template(ckpt::inspect(path, &io));
    ckpt::load(t, path, ckpt::LoadOptions().io(&io));
    for (auto& [k, v] : t)
      if (v.is_tensor()) out.insert_or_assign(k, v);
    return out;
  }
  if (ends_with(path, ".pt") || ends_with(path, ".pth") || ends_with(path, ".bin")) {
    fsdp::StateDict sd = ckpt::load_pt(path, &io);
    std::function<void(const fsdp::StateValue&, const std::string&)> go =
        [&](const fsdp::StateValue& v, const std::string& k) {
          if (v.is_tensor()) out.insert_or_assign(k, v);
          if (v.is_dict())
            for (const auto& [kk, x] : v.dict()) go(x, k.empty() ? kk : k + "." + kk);
        };
    go(fsdp::StateValue(sd), "");
    return out;
  }
  return ckpt::load_safetensors(path, &io);
}

int inspect(const std::string& dir, FileIO& io, const Output& o) {
  const ckpt::CheckpointInfo info = ckpt::inspect(dir, &io);
  o.out << "checkpoint " << dir << "\n";
  if (info.has_manifest) {
    o.out << "  format version " << info.format_version << ", saved by " << info.world_size
          << " rank(s) with fsdp-cpp " << info.library_version << " (LibTorch "
          << info.torch_version << ") at " << saved_when(info.created_unix) << "\n";
    for (const auto& [k, v] : info.annotations) o.out << "  " << k << ": " << v << "\n";
  } else {
    o.out << "  no manifest: written by PyTorch DCP (or another tool); not verifiable\n";
  }
  int64_t total = 0, tensors = 0;
  for (const auto& e : info.entries) {
    total += e.stored_bytes;
    tensors += e.tensor;
  }
  o.out << "  " << info.entries.size() << " keys (" << tensors << " tensors), " << info.files.size()
        << " data file(s), " << human(total) << " stored\n";
  for (const auto& e : info.entries) {
    if (e.tensor) {
      o.out << "  " << e.key << "  " << dtype_name(e.dtype) << " " << dims(e.shape) << "  "
            << e.chunks << " chunk(s), " << human(e.stored_bytes) << "\n";
    } else {
      o.out << "  " << e.key << "  value, " << human(e.stored_bytes) << "\n";
    }
  }
  return 0;
}

int verify(const std::string& dir, FileIO& io, const Output& o) {
  const ckpt::VerifyReport rep =
      ckpt::verify(dir, &io, o.progress ? progress_bar : std::function<void(int64_t, int64_t)>());
  for (const auto& p : rep.problems) o.err << "fsdp-ckpt: " << first_line(p) << "\n";
  if (!rep.ok()) return 1;
  o.out << "ok: " << dir << ": " << rep.items << " items, " << human(rep.bytes)
        << " checked against their xxh3 checksums (format version " << rep.format_version
        << ", saved by " << rep.world_size << " rank(s))\n";
  if (!rep.elsewhere.empty()) {
    o.out << "  a node-local save: " << rep.elsewhere.size()
          << " data file(s) are in other hosts' directories, not checked here:";
    for (const auto& f : rep.elsewhere) o.out << " " << f;
    o.out << "\n";
  }
  return 0;
}

int convert(const std::string& src, const std::string& dst, const std::string& to,
            const std::optional<std::string>& prefix, int64_t max_shard_bytes, FileIO& io,
            const Output& o) {
  const auto opts = ckpt::ExportOptions().prefix(prefix).max_shard_bytes(max_shard_bytes).io(&io);
  if (to == "safetensors") {
    for (const auto& f : ckpt::export_safetensors(src, dst, opts)) o.out << "wrote " << f << "\n";
  } else if (to == "pt") {
    ckpt::export_pt(src, dst, opts);
    o.out << "wrote " << dst << "\n";
  } else if (to == "dcp") {  // tensors from a safetensors or .pt export, under `prefix` again
    fsdp::StateDict sd = tensors_of(src, io);
    const size_t n = sd.size();
    std::string top = prefix.value_or("model.");
    if (!top.empty() && top.back() == '.') top.pop_back();
    if (!top.empty()) {
      fsdp::StateDict outer;
      outer.insert_or_assign(top, std::move(sd));
      sd = std::move(outer);
    }
    ckpt::save(sd, dst, ckpt::SaveOptions().io(&io));
    o.out << "wrote checkpoint " << dst << " (" << n << " tensors)\n";
  } else {
    throw fsdp::ValueError("fsdp-ckpt convert: --to takes safetensors, pt or dcp, not '" + to +
                           "'");
  }
  return 0;
}

int diff(const std::string& a_path, const std::string& b_path, double rtol, double atol,
         const std::string& strip_a, const std::string& strip_b, FileIO& io, const Output& o) {
  const fsdp::StateDict a = strip(tensors_of(a_path, io), strip_a);
  const fsdp::StateDict b = strip(tensors_of(b_path, io), strip_b);
  int differences = 0;
  double largest = 0;
  std::string largest_key;
  auto report = [&](const std::string& line) {
    o.out << line << "\n";
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
    o.out << "largest abs difference: " << shortest(largest) << " (" << largest_key << ")\n";
  if (differences == 0)
    o.out << "same: " << a.size() << " tensors equal within rtol " << rtol << ", atol " << atol
          << "\n";
  return differences == 0 ? 0 : 1;
}

int assemble(const std::string& out_dir, const std::vector<std::string>& dirs, FileIO& io,
             const Output& o) {
  ckpt::assemble(dirs, out_dir, &io);
  o.out << "ok: " << out_dir << " assembled from " << dirs.size() << " directories and verified\n";
  return 0;
}

}  // namespace fsdp_ckpt
