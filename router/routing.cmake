# Router's prefix index and routing policy (pure libraries). Included from router/CMakeLists.txt.
strata_add_library(router_routing
  SOURCES
    prefix_index.cc
    retry_budget.cc
    routing_policy.cc
  DEPS
    strata::common absl::status absl::statusor absl::strings absl::str_format absl::span
    absl::time absl::hash absl::flat_hash_map absl::flat_hash_set
    absl::inlined_vector)

strata_add_test(routing_test
  SOURCES routing_test.cc retry_budget_test.cc
  DEPS strata::router_routing)
