// libFuzzer target for the store's recovery from its block log: any bytes, as the one file of a
// store's block log with no index beside it, must open (the index is rebuilt from the log's tag
// records), never crash, and every block the store then lists must read back whole and verify.
// A log written by a real store is in the seeds (make_block_seeds), so mutations start from
// tagged, checksummed records.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "common/block_reader.h"
#include "kvstore/block_store.h"

namespace {

const std::string& Dir() {
  static const std::string dir = [] {
    char tmpl[] = "/tmp/strata-block-log-fuzz-XXXXXX";
    const char* d = mkdtemp(tmpl);
    if (d == nullptr) std::abort();
    return std::string(d);
  }();
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace strata;
  namespace fs = std::filesystem;
  const fs::path root = Dir();
  std::error_code ec;
  fs::remove_all(root / "store", ec);
  fs::create_directories(root / "store" / "blocks", ec);
  {
    FILE* f = std::fopen((root / "store" / "blocks" / "1.log").c_str(), "wb");
    if (f == nullptr) std::abort();
    if (size > 0 && std::fwrite(data, 1, size, f) != size) std::abort();
    std::fclose(f);
  }
  kvstore::StoreOptions o;
  o.ram_bytes = size_t{1} << 20;
  o.disk_path = (root / "store").string();
  o.disk_bytes = size_t{1} << 30;
  o.event_ring = 16;
  absl::StatusOr<std::unique_ptr<kvstore::BlockStore>> store = kvstore::BlockStore::Open(o);
  if (!store.ok()) __builtin_trap();  // no index at all is a fresh one: it must open
  const kvstore::StoreStats stats = (*store)->Stats();
  const kvstore::StoreSnapshot snap = (*store)->Snapshot();
  if (snap.blocks.size() != stats.index_recovered_blocks) __builtin_trap();
  for (const kvstore::StoredBlock& b : snap.blocks) {
    absl::StatusOr<kvstore::Lease> lease = (*store)->Get(b.name);
    if (!lease.ok()) __builtin_trap();  // listed, so readable
    absl::StatusOr<BlockView> view = BlockView::Parse(lease->bytes());
    if (!view.ok() || view->header().layer != b.name.layer ||
        view->header().model_fingerprint != b.name.model_fingerprint) {
      __builtin_trap();
    }
  }
  return 0;
}
