#include "tools/replay_command.h"

#include <cmath>
#include <fstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "kernels/codec.h"
#include "kvstore/replay.h"
#include "nlohmann/json.hpp"
#include "tools/progress.h"

namespace strata::tools {

namespace {

// A size in the largest binary unit that leaves at least 1 (16M, 1.6M, 256G), one decimal
// where it is not whole.
std::string SizeText(uint64_t b) {
  const char* units = "KMGT";
  double x = b;
  int u = -1;
  while (u < 3 && x >= 1024) {
    x /= 1024;
    ++u;
  }
  if (u < 0) return absl::StrFormat("%dB", b);
  return x == std::floor(x) ? absl::StrFormat("%.0f%c", x, units[u])
                            : absl::StrFormat("%.1f%c", x, units[u]);
}

}  // namespace

absl::Status RunReplay(const ReplayOptions& o, std::ostream& out) {
  if (o.ram_bytes.empty()) return absl::InvalidArgumentError("replay: no RAM sizes to sweep");
  std::vector<kvstore::StoreLayout> layouts;
  for (const std::string& l : o.layouts) {
    STRATA_ASSIGN_OR_RETURN(kvstore::StoreLayout layout, kvstore::ParseStoreLayout(l));
    layouts.push_back(layout);
  }
  if (layouts.empty()) return absl::InvalidArgumentError("replay: no store layouts");
  if (o.hosts == 0) return absl::InvalidArgumentError("replay: --hosts must be at least 1");
  STRATA_ASSIGN_OR_RETURN(std::vector<kvstore::TraceRequest> trace,
                          kvstore::LoadMooncakeTrace(o.trace_file));
  nlohmann::json report = {{"trace", o.trace_file},
                           {"requests", trace.size()},
                           {"layers", o.layers},
                           {"kv_heads", o.kv_heads},
                           {"head_dim", o.head_dim},
                           {"block_tokens", o.block_tokens},
                           {"disk_bytes", o.disk_bytes},
                           {"durable_puts", o.durable_puts},
                           {"hosts", o.hosts},
                           {"shared_bytes", o.shared_bytes},
                           {"shared_masters", o.shared_masters},
                           {"shared_baseline_bytes", o.shared_baseline_bytes},
                           {"shared_lru_samples", o.shared_lru_samples},
                           {"prefill_tokens_per_s", o.prefill_tokens_per_s},
                           {"in_flight", o.in_flight && o.prefill_tokens_per_s > 0},
                           {"decode_puts", o.decode_puts},
                           {"seed", o.seed},
                           {"runs", nlohmann::json::array()}};
  out << absl::StrFormat(
      "trace %s: %d requests; model %d layers x %d KV heads x %d dims; %d-token chunks; disk %s\n",
      o.trace_file, trace.size(), o.layers, o.kv_heads, o.head_dim, o.block_tokens,
      o.durable_puts ? "written through (durable puts)" : "written back (on eviction)");
  out << (o.decode_puts ? "decode nodes store the chunks they complete, and the prompt's where "
                          "their host's store lacks it (a decode host drawn at random)\n"
                        : "decode nodes store nothing\n");
  const bool clustered = layouts.size() > 1 || layouts[0] != kvstore::StoreLayout::kCentral;
  if (clustered) {
    out << absl::StrFormat(
        "layouts over %d hosts (RAM and disk per store: one machine's); shared tier %s on %d "
        "masters (%s each before any key), %s, a chunk a Redis hash of its layers (jemalloc's "
        "size classes and Redis's structures counted); router: prefix overlap%s\n",
        o.hosts, SizeText(o.shared_bytes), o.shared_masters, SizeText(o.shared_baseline_bytes),
        o.shared_lru_samples > 0
            ? absl::StrFormat("Redis's LRU sampling %d keys per eviction", o.shared_lru_samples)
            : std::string("exact LRU"),
        o.prefill_tokens_per_s > 0
            ? absl::StrFormat(
                  " and load (%.0f prefill tokens/s per host)%s", o.prefill_tokens_per_s,
                  o.in_flight ? "; a request's chunks stored once its host prefilled it" : "")
            : std::string(" alone"));
  }
  out << absl::StrFormat(
      "%-16s %6s %8s %6s %6s %7s %11s | %7s %7s %9s %9s %9s %9s %8s %8s %8s %9s\n", "codec", "bits",
      "chunk MB", "RAM", "disk", "policy", "layout", "chunk%", "token%", "saved Mtok", "RAM GB rd",
      "disk GB rd", "disk GB wr", "RAM evic", "orphans", "shared%", "sh orphan");
  Progress progress("replay", o.codecs.size() * (o.disk_bytes != 0 ? 2 : 1) * o.policies.size() *
                                  o.ram_bytes.size() * layouts.size());
  for (const std::string& spec : o.codecs) {
    STRATA_ASSIGN_OR_RETURN(kernels::CodecSpec parsed, kernels::CodecSpec::Parse(spec));
    if (parsed.needs_calibration()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "replay: ", spec, " needs a calibration; use a codec of the same size that does not"));
    }
    // The block size a real block of this shape has (nominal: chunks other than the first).
    STRATA_ASSIGN_OR_RETURN(
        double bits, kernels::Codec(parsed).BitsPerElement(o.block_tokens, o.kv_heads, o.head_dim));
    const uint64_t chunk_bytes = static_cast<uint64_t>(
        bits / 8.0 * 2.0 * o.block_tokens * o.kv_heads * o.head_dim * o.layers + 0.5);
    for (const uint64_t disk : {uint64_t{0}, o.disk_bytes}) {
      for (const std::string& pol : o.policies) {
        STRATA_ASSIGN_OR_RETURN(kvstore::PolicyKind policy, kvstore::ParsePolicy(pol));
        for (uint64_t ram : o.ram_bytes) {
          for (const kvstore::StoreLayout layout : layouts) {
            const kvstore::ReplayResult r =
                kvstore::ReplayCluster(trace, {.store = {.block_tokens = o.block_tokens,
                                                         .chunk_bytes = chunk_bytes,
                                                         .ram_bytes = ram,
                                                         .disk_bytes = disk,
                                                         .ram_policy = policy,
                                                         .durable_puts = o.durable_puts},
                                               .layout = layout,
                                               .hosts = o.hosts,
                                               .shared_bytes = o.shared_bytes,
                                               .shared_layers = o.layers,
                                               .shared_masters = o.shared_masters,
                                               .shared_baseline_bytes = o.shared_baseline_bytes,
                                               .shared_lru_samples = o.shared_lru_samples,
                                               .prefill_tokens_per_s = o.prefill_tokens_per_s,
                                               .seed = o.seed,
                                               .in_flight = o.in_flight,
                                               .decode_puts = o.decode_puts});
            const uint64_t hits = r.chunk_hits_ram + r.chunk_hits_disk + r.chunk_hits_shared;
            out << absl::StrFormat(
                       "%-16s %6.3f %8.2f %6s %6s %7s %11s | %6.2f%% %6.2f%% %9.2f %9.1f %9.1f "
                       "%9.1f %8d "
                       "%8d %7.1f%% %9s\n",
                       spec, bits, chunk_bytes / 1e6, SizeText(ram), disk ? SizeText(disk) : "-",
                       pol, kvstore::StoreLayoutName(layout), 100 * r.chunk_hit_rate(),
                       100 * r.token_hit_rate(), r.tokens_saved / 1e6, r.bytes_read_ram / 1e9,
                       r.bytes_read_disk / 1e9, r.bytes_written_disk / 1e9, r.ram_evictions,
                       r.orphans_dropped, hits ? 100.0 * r.chunk_hits_shared / hits : 0.0,
                       layout == kvstore::StoreLayout::kSharedTier
                           ? absl::StrFormat("%d/%d", r.shared_orphans, r.shared_chunks)
                           : std::string("-"))
                << std::flush;
            progress.Advance(1, absl::StrCat(spec, " ", SizeText(ram), " ", pol, " ",
                                             kvstore::StoreLayoutName(layout)));
            report["runs"].push_back({{"codec", spec},
                                      {"layout", kvstore::StoreLayoutName(layout)},
                                      {"chunk_hits_shared", r.chunk_hits_shared},
                                      {"bytes_read_shared", r.bytes_read_shared},
                                      {"bytes_written_shared", r.bytes_written_shared},
                                      {"shared_evictions", r.shared_evictions},
                                      {"shared_chunks", r.shared_chunks},
                                      {"shared_orphans", r.shared_orphans},
                                      {"host_requests", r.host_requests},
                                      {"decode_writers", r.decode_writers},
                                      {"decode_generated_chunks", r.decode_generated_chunks},
                                      {"decode_prompt_copies", r.decode_prompt_copies},
                                      {"bits_per_element", bits},
                                      {"chunk_bytes", chunk_bytes},
                                      {"ram_bytes", ram},
                                      {"disk_bytes", disk},
                                      {"policy", pol},
                                      {"chunk_hit_rate", r.chunk_hit_rate()},
                                      {"token_hit_rate", r.token_hit_rate()},
                                      {"tokens_requested", r.tokens_requested},
                                      {"tokens_saved", r.tokens_saved},
                                      {"chunk_hits_ram", r.chunk_hits_ram},
                                      {"chunk_hits_disk", r.chunk_hits_disk},
                                      {"bytes_read_ram", r.bytes_read_ram},
                                      {"bytes_read_disk", r.bytes_read_disk},
                                      {"bytes_written_disk", r.bytes_written_disk},
                                      {"ram_evictions", r.ram_evictions},
                                      {"disk_evictions", r.disk_evictions},
                                      {"promotions", r.promotions},
                                      {"orphans_dropped", r.orphans_dropped}});
          }
        }
      }
      if (o.disk_bytes == 0) break;  // no "with disk" runs
    }
  }
  if (!o.json_out.empty()) {
    std::ofstream f(o.json_out);
    f << report.dump(1) << "\n";
    if (!f) return absl::InternalError(absl::StrCat("replay: cannot write ", o.json_out));
    out << "wrote " << o.json_out << "\n";
  }
  return absl::OkStatus();
}

}  // namespace strata::tools
