# The router process: the cluster backend (gRPC to the prefill and decode nodes, the store's block
# events feeding the prefix index) and the strata-router executable. Included from
# router/CMakeLists.txt.
find_package(prometheus-cpp CONFIG REQUIRED)

strata_add_library(router_cluster
  SOURCES
    cluster_backend.cc
    node_pool.cc
    shared_tier_probe.cc
    store_feed.cc
  DEPS
    strata::router_http strata::router_routing strata::serving strata::kvstore_service
    strata::proto strata::model prometheus-cpp::core)

add_executable(strata-router router_main.cc)
target_link_libraries(strata-router PRIVATE strata::router_cluster strata::rpc_flags
  strata::kvstore_shared_tier_flags strata::membership_flags
  absl::flags absl::flags_parse absl::flags_usage)
strata_configure_target(strata-router)
strata_use_allocator(strata-router)

# Against real gRPC servers on loopback (fake nodes, a real store). Not under TSan: Debian's gRPC
# is not instrumented (as kvstore_service_test and router_http_test).
if(NOT STRATA_SANITIZE STREQUAL "thread")
  strata_add_test(router_cluster_test
    SOURCES
      cluster_backend_test.cc
      store_feed_test.cc
    DEPS strata::router_cluster strata::kvstore strata::kernels
    TIMEOUT 120)
  if(TARGET router_cluster_test)
    target_compile_definitions(router_cluster_test PRIVATE
      STRATA_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
  endif()
endif()
