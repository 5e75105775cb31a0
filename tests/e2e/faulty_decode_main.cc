// strata-decode-faulty: strata-decode with a failpoint, for the fault tests only (never
// installed): --damage_received_blocks=N flips a byte of the first copy of every Nth distinct
// block that arrives, after the network (as a bad link or DMA would); the copy sent again arrives
// intact. deploy/local/cluster.sh --decode-bin runs it in place of strata-decode.
#include <memory>
#include <mutex>
#include <string>

#include "absl/container/flat_hash_set.h"
#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "decode_node/decode_node_main.h"
#include "serving/node_process.h"
#include "transport/testing/fault_injecting_transport.h"

ABSL_FLAG(int, damage_received_blocks, 0,
          "fault tests: damage the first copy of every Nth distinct block that arrives (0: none)");

int main(int argc, char** argv) {
  return strata::decode::RunDecodeNode(
      argc, argv,
      [](strata::transport::Transport* base)
          -> absl::StatusOr<std::unique_ptr<strata::transport::Transport>> {
        const int n = absl::GetFlag(FLAGS_damage_received_blocks);
        if (n < 0) {
          return absl::InvalidArgumentError(
              absl::StrCat("--damage_received_blocks must be >= 0, got ", n));
        }
        if (n == 0) return nullptr;
        auto damaging = std::make_unique<strata::transport::FaultInjectingTransport>(base);
        damaging->corrupt_block =
            [n, mu = std::make_shared<std::mutex>(),
             seen = std::make_shared<absl::flat_hash_set<std::string>>()](absl::string_view id) {
              std::lock_guard<std::mutex> lock(*mu);
              return seen->insert(std::string(id)).second && seen->size() % n == 0;
            };
        strata::serving::Log("", absl::StrCat("FAILPOINT: damaging every ", n,
                                              "th block that arrives (--damage_received_blocks)"));
        return std::unique_ptr<strata::transport::Transport>(std::move(damaging));
      });
}
