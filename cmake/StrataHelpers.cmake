# Helpers that give every Strata target the same flags. Warnings-as-errors and sanitizers apply
# to project code only, never to dependencies (which come prebuilt from Debian).

set(STRATA_WARNINGS -Wall -Wextra -Werror)

set(STRATA_SANITIZE_FLAGS "")
if(STRATA_SANITIZE STREQUAL "address")
  set(STRATA_SANITIZE_FLAGS -fsanitize=address,undefined -fno-sanitize-recover=undefined
                            -fno-omit-frame-pointer)
elseif(STRATA_SANITIZE STREQUAL "thread")
  set(STRATA_SANITIZE_FLAGS -fsanitize=thread -fno-omit-frame-pointer)
elseif(NOT STRATA_SANITIZE STREQUAL "")
  message(FATAL_ERROR "STRATA_SANITIZE must be '', 'address' or 'thread', not '${STRATA_SANITIZE}'")
endif()

# Fuzzing builds instrument all project code for libFuzzer's coverage feedback.
if(STRATA_BUILD_FUZZERS)
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "STRATA_BUILD_FUZZERS=ON needs clang (CXX=clang++); see scripts/fuzz.sh")
  endif()
  list(APPEND STRATA_SANITIZE_FLAGS -fsanitize=fuzzer-no-link)
endif()

# Applies project compile options to a C++ target.
function(strata_configure_target target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:${STRATA_WARNINGS} ${STRATA_SANITIZE_FLAGS}>)
  target_link_options(${target} PRIVATE ${STRATA_SANITIZE_FLAGS})
endfunction()

# strata_add_library(name SOURCES ... DEPS ...): static library strata_<name>, alias strata::<name>,
# include root at the repository top (so includes read "common/status_macros.h").
function(strata_add_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(strata_${name} STATIC ${ARG_SOURCES})
  add_library(strata::${name} ALIAS strata_${name})
  target_include_directories(strata_${name} PUBLIC ${PROJECT_SOURCE_DIR})
  target_link_libraries(strata_${name} PUBLIC ${ARG_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
  # Sanitizer flags are public so that every binary linking a sanitized library is sanitized too.
  target_compile_options(strata_${name} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${STRATA_WARNINGS}>)
  target_compile_options(strata_${name} PUBLIC $<$<COMPILE_LANGUAGE:CXX>:${STRATA_SANITIZE_FLAGS}>)
  target_link_options(strata_${name} PUBLIC ${STRATA_SANITIZE_FLAGS})
endfunction()

# strata_add_test(name SOURCES ... DEPS ... LABELS ... [TIMEOUT s] [ENVIRONMENT VAR=value...]): a
# GoogleTest binary registered with CTest
# (each TEST is its own CTest test, via gtest_discover_tests). Default label: unit.
function(strata_add_test name)
  if(NOT STRATA_BUILD_TESTS)
    return()
  endif()
  cmake_parse_arguments(ARG "" "TIMEOUT" "SOURCES;DEPS;LABELS;ENVIRONMENT" ${ARGN})
  if(NOT ARG_LABELS)
    set(ARG_LABELS unit)
  endif()
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 300)
  endif()
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} GTest::gmock GTest::gtest_main)
  strata_configure_target(${name})
  if("unit" IN_LIST ARG_LABELS)
    set_property(GLOBAL APPEND PROPERTY STRATA_UNIT_TESTS ${name})
  endif()
  include(GoogleTest)
  gtest_discover_tests(${name}
    WORKING_DIRECTORY ${PROJECT_SOURCE_DIR}
    PROPERTIES LABELS "${ARG_LABELS}" TIMEOUT ${ARG_TIMEOUT} ENVIRONMENT "${ARG_ENVIRONMENT}"
    DISCOVERY_TIMEOUT 60)
endfunction()

# strata_add_benchmark(name SOURCES ... DEPS ...): a Google Benchmark binary (not run by CTest).
function(strata_add_benchmark name)
  if(NOT STRATA_BUILD_BENCHMARKS)
    return()
  endif()
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} benchmark::benchmark_main)
  strata_configure_target(${name})
endfunction()
