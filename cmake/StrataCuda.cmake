# STRATA_CUDA=AUTO|ON|OFF. AUTO builds the CUDA targets when nvcc is found (on PATH, in CUDACXX,
# or at /usr/local/cuda/bin/nvcc) and leaves them out otherwise. Sets STRATA_HAVE_CUDA_BUILD.
#
# STRATA_CUDA_CODE=full (the default) generates code for sm_80 (A100) and sm_90a (H100/H200,
# arch-specific features such as wgmma), plus compute_90 PTX so that newer GPUs can JIT it.
# STRATA_CUDA_CODE=ptx generates compute_80 PTX only: a third of the compile time (paged_decode.cu:
# 15 s against 51 s), for a machine with no GPU that only needs CUDA code to compile and its
# GPU tests to skip (scripts/build.sh's choice where no GPU is visible, hence CI); any sm_80+ GPU
# can still JIT it. It runs no ptxas, so register and shared-memory limits are checked only by
# full builds (scripts/gpu_bundle.sh).
set(STRATA_CUDA_CODE "full" CACHE STRING "CUDA code generated: full (sm_80, sm_90a, compute_90 PTX) or ptx (compute_80 PTX only)")
set_property(CACHE STRATA_CUDA_CODE PROPERTY STRINGS full ptx)

set(STRATA_HAVE_CUDA_BUILD OFF)
if(NOT STRATA_CUDA STREQUAL "OFF")
  if(NOT DEFINED CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX}
     AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(CMAKE_CUDA_ARCHITECTURES OFF)
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    # CMake 3.25 does not know nvcc 13's C++20 flag; teach it, then ask for C++20 as for CXX.
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA_STANDARD 20)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    if(STRATA_CUDA_CODE STREQUAL "ptx")
      set(STRATA_CUDA_GENCODE -gencode=arch=compute_80,code=compute_80)
    elseif(STRATA_CUDA_CODE STREQUAL "full")
      set(STRATA_CUDA_GENCODE
        -gencode=arch=compute_80,code=sm_80
        -gencode=arch=compute_90a,code=sm_90a
        -gencode=arch=compute_90,code=compute_90)
    else()
      message(FATAL_ERROR "STRATA_CUDA_CODE must be full or ptx, not '${STRATA_CUDA_CODE}'")
    endif()
    set(STRATA_CUDA_FLAGS
      ${STRATA_CUDA_GENCODE}
      -Xcompiler=-Wall,-Wextra,-Werror
      --Werror=all-warnings)
    set(STRATA_HAVE_CUDA_BUILD ON)
  elseif(STRATA_CUDA STREQUAL "ON")
    message(FATAL_ERROR "STRATA_CUDA=ON but no CUDA compiler was found")
  else()
    message(STATUS "Strata: nvcc not found; CUDA targets are left out (STRATA_CUDA=AUTO)")
  endif()
endif()

# Applies Strata's CUDA code-generation and warning flags to a target's .cu sources.
function(strata_configure_cuda target)
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:${STRATA_CUDA_FLAGS}>)
endfunction()
