#include "membership/cluster_file.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/host_port.h"
#include "nlohmann/json.hpp"

namespace strata::membership {
namespace {

using json = nlohmann::json;

absl::Status Bad(const std::string& path, const std::string& field, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", field, ": ", what));
}

// Reads an optional string member; kInvalidArgument when present with another type.
absl::Status GetString(const json& obj, const char* key, const std::string& path,
                       const std::string& where, std::string* out) {
  auto it = obj.find(key);
  if (it == obj.end()) return absl::OkStatus();
  if (!it->is_string()) return Bad(path, where + key, "must be a string");
  *out = it->get<std::string>();
  return absl::OkStatus();
}

absl::Status CheckKeys(const json& obj, std::initializer_list<const char*> allowed,
                       const std::string& path, const std::string& where) {
  for (auto it = obj.begin(); it != obj.end(); ++it) {
    bool ok = false;
    for (const char* a : allowed) ok = ok || it.key() == a;
    if (!ok) return Bad(path, where + it.key(), "unknown key");
  }
  return absl::OkStatus();
}

std::string Resolve(const std::string& base_dir, const std::string& p) {
  if (p.empty() || std::filesystem::path(p).is_absolute()) return p;
  return (std::filesystem::path(base_dir) / p).lexically_normal().string();
}

}  // namespace

bool ValidNodeId(const std::string& id) {
  if (id.empty() || id.size() > 64) return false;
  if (id == "store" || id == "shared-tier") return false;  // the router's holder ids
  for (char c : id) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-')) {
      return false;
    }
  }
  return true;
}

const char* RoleName(Role role) { return role == Role::kPrefill ? "prefill" : "decode"; }

const NodeSpec* ClusterSpec::Find(const std::string& id) const {
  for (const NodeSpec& n : nodes) {
    if (n.id == id) return &n;
  }
  return nullptr;
}

std::vector<NodeSpec> ClusterSpec::WithRole(Role role) const {
  std::vector<NodeSpec> out;
  for (const NodeSpec& n : nodes) {
    if (n.role == role) out.push_back(n);
  }
  return out;
}

absl::Status ValidateHostPort(const std::string& address, const std::string& what) {
  absl::StatusOr<HostPort> hp = ParseHostPort(address);
  if (!hp.ok()) return absl::InvalidArgumentError(absl::StrCat(what, ": ", hp.status().message()));
  return absl::OkStatus();
}

absl::StatusOr<ClusterSpec> ParseClusterFile(const std::string& text, const std::string& path) {
  json doc = json::parse(text, nullptr, /*allow_exceptions=*/false, /*ignore_comments=*/true);
  if (doc.is_discarded()) return Bad(path, "(file)", "not valid JSON");
  if (!doc.is_object()) return Bad(path, "(file)", "must be a JSON object");
  if (absl::Status s = CheckKeys(
          doc, {"model", "codec", "chunk_tokens", "calibration", "store", "nodes", "router"}, path,
          "");
      !s.ok()) {
    return s;
  }
  ClusterSpec spec;
  spec.path = path;
  const std::string base = std::filesystem::path(path).parent_path().string();
  for (auto [key, dst] :
       {std::pair{"model", &spec.model}, std::pair{"codec", &spec.codec},
        std::pair{"calibration", &spec.calibration}, std::pair{"store", &spec.store}}) {
    if (absl::Status s = GetString(doc, key, path, "", dst); !s.ok()) return s;
  }
  if (spec.model.empty()) return Bad(path, "model", "is required (the model's folder)");
  spec.model = Resolve(base, spec.model);
  spec.calibration = Resolve(base, spec.calibration);
  if (spec.codec.empty()) return Bad(path, "codec", "must not be empty");
  if (auto it = doc.find("chunk_tokens"); it != doc.end()) {
    if (!it->is_number_unsigned() || it->get<uint64_t>() == 0 || it->get<uint64_t>() > 65536) {
      return Bad(path, "chunk_tokens", "must be an integer in 1..65536");
    }
    spec.chunk_tokens = it->get<uint32_t>();
  }
  if (!spec.store.empty()) {
    if (absl::Status s = ValidateHostPort(spec.store, path + ": store"); !s.ok()) return s;
  }
  if (auto it = doc.find("router"); it != doc.end()) {
    if (!it->is_object()) return Bad(path, "router", "must be an object");
    if (absl::Status s = CheckKeys(*it, {"http"}, path, "router."); !s.ok()) return s;
    if (absl::Status s = GetString(*it, "http", path, "router.", &spec.router_http); !s.ok()) {
      return s;
    }
    if (absl::Status s = ValidateHostPort(spec.router_http, path + ": router.http"); !s.ok()) {
      return s;
    }
  }
  auto nodes = doc.find("nodes");
  if (nodes == doc.end() || !nodes->is_array() || nodes->empty()) {
    return Bad(path, "nodes", "must be a non-empty array");
  }
  absl::flat_hash_set<std::string> ids;
  for (size_t i = 0; i < nodes->size(); ++i) {
    const json& n = (*nodes)[i];
    const std::string where = absl::StrCat("nodes[", i, "].");
    if (!n.is_object()) return Bad(path, absl::StrCat("nodes[", i, "]"), "must be an object");
    if (absl::Status s =
            CheckKeys(n, {"id", "role", "grpc", "transport", "metrics", "store"}, path, where);
        !s.ok()) {
      return s;
    }
    NodeSpec node;
    std::string role;
    for (auto [key, dst] : {std::pair{"id", &node.id}, std::pair{"role", &role},
                            std::pair{"grpc", &node.grpc}, std::pair{"transport", &node.transport},
                            std::pair{"metrics", &node.metrics}, std::pair{"store", &node.store}}) {
      if (absl::Status s = GetString(n, key, path, where, dst); !s.ok()) return s;
    }
    if (!ValidNodeId(node.id)) {
      return Bad(path, where + "id", kNodeIdRule);
    }
    if (!ids.insert(node.id).second) return Bad(path, where + "id", "'" + node.id + "' repeats");
    if (role == "prefill") {
      node.role = Role::kPrefill;
    } else if (role == "decode") {
      node.role = Role::kDecode;
    } else {
      return Bad(path, where + "role", "must be \"prefill\" or \"decode\"");
    }
    if (absl::Status s = ValidateHostPort(node.grpc, path + ": " + where + "grpc"); !s.ok()) {
      return s;
    }
    if (node.role == Role::kDecode) {
      if (absl::Status s = ValidateHostPort(node.transport, path + ": " + where + "transport");
          !s.ok()) {
        return s;
      }
    }
    if (!node.metrics.empty()) {
      if (absl::Status s = ValidateHostPort(node.metrics, path + ": " + where + "metrics");
          !s.ok()) {
        return s;
      }
    }
    if (!node.store.empty()) {
      if (absl::Status s = ValidateHostPort(node.store, path + ": " + where + "store"); !s.ok()) {
        return s;
      }
    }
    spec.nodes.push_back(std::move(node));
  }
  if (spec.WithRole(Role::kPrefill).empty()) return Bad(path, "nodes", "no prefill node");
  if (spec.WithRole(Role::kDecode).empty()) return Bad(path, "nodes", "no decode node");
  return spec;
}

absl::StatusOr<ClusterSpec> LoadClusterFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read cluster file '", path, "'"));
  std::stringstream ss;
  ss << in.rdbuf();
  return ParseClusterFile(ss.str(), path);
}

}  // namespace strata::membership
