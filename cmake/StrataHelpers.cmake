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

# Links a program with the service's malloc: jemalloc where STRATA_JEMALLOC (CMakeLists.txt).
# Large blocks are past glibc's mmap threshold, so glibc maps, faults in and unmaps each one;
# jemalloc reuses freed extents (common/allocator.h). Linked whether or not the program names a
# jemalloc symbol (--no-as-needed), so that it is the malloc the process resolves.
function(strata_use_allocator target)
  if(STRATA_JEMALLOC)
    # One item, so that CMake keeps the flags around the library.
    list(JOIN JEMALLOC_LINK_LIBRARIES "," libs)
    target_link_libraries(${target} PRIVATE "-Wl,--push-state,--no-as-needed,${libs},--pop-state")
    target_compile_definitions(${target} PRIVATE STRATA_LINKS_JEMALLOC=1)
  endif()
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

# strata_plugin_code(targets...): the targets' code goes into plugins (shared objects opened with
# dlopen) as well as into executables, so it is compiled position-independent; without semantic
# interposition, so that -fPIC optimizes as -fPIE does (calls within the code stay inlinable).
function(strata_plugin_code)
  foreach(target IN LISTS ARGN)
    set_target_properties(${target} PROPERTIES POSITION_INDEPENDENT_CODE ON)
    target_compile_options(${target} PRIVATE
      $<$<COMPILE_LANGUAGE:CXX>:-fno-semantic-interposition>
      $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-fno-semantic-interposition>)
  endforeach()
endfunction()

# strata_add_plugin(name SOURCES ... DEPS ... OUTPUT_DIRECTORY dir): a shared object opened with
# dlopen (lib<name>.so in dir). It carries its own copy of the static libraries it links, their
# symbols hidden (--exclude-libs), and exports only what its sources mark visibility("default");
# every symbol must resolve when it is linked (-z defs; not under sanitizers).
function(strata_add_plugin name)
  cmake_parse_arguments(ARG "" "OUTPUT_DIRECTORY" "SOURCES;DEPS" ${ARGN})
  add_library(${name} MODULE ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS})
  set_target_properties(${name} PROPERTIES
    LIBRARY_OUTPUT_DIRECTORY ${ARG_OUTPUT_DIRECTORY}
    CXX_VISIBILITY_PRESET hidden
    VISIBILITY_INLINES_HIDDEN ON)
  target_link_options(${name} PRIVATE -Wl,--exclude-libs,ALL)
  if(STRATA_SANITIZE STREQUAL "")  # sanitizer runtimes live in the executable
    target_link_options(${name} PRIVATE -Wl,-z,defs)
  endif()
  strata_configure_target(${name})
endfunction()
