// GoogleTest's main for test binaries whose kernels dispatch on the CPU's features, with one flag
// of its own: --strata_isa=native|avx2|portable caps the features (CapCpuFeatures) before any
// test runs, so that a CTest entry runs the slower kernels on a machine that has faster ones.
#include <cstdio>
#include <string_view>

#include "common/cpu_features.h"
#include "gtest/gtest.h"

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);  // takes the --gtest_ flags out of argv
  for (int i = 1; i < argc; ++i) {
    std::string_view a = argv[i];
    strata::IsaCap cap;
    if (a.substr(0, 13) == "--strata_isa=" && strata::ParseIsaCap(a.substr(13), &cap)) {
      strata::CapCpuFeatures(cap);
      std::printf("CPU features capped: %s\n", argv[i]);
      continue;
    }
    std::fprintf(stderr, "unknown flag %s (--strata_isa=native|avx2|portable)\n", argv[i]);
    return 2;
  }
  return RUN_ALL_TESTS();
}
