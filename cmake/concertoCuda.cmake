# The GPU side of concerto: CUDA as a language (for the tests, the benchmark and any
# consumer that compiles the CUDA kernels) and the extra pieces of concerto::nccl.
# CUDA stays optional: without nvcc, or without NCCL, nothing here is defined and the rest
# of the project builds as before.
#
# Sets CONCERTO_HAS_CUDA (ON when the CUDA language is enabled and concerto::nccl exists).
# Provides concerto_cuda_sources(<target>): compiles the target's .cpp sources with nvcc, so
# that one source builds for concerto::mpi (g++) and for concerto::nccl (nvcc).

# Extra pieces of concerto::nccl (the target itself is made in the top-level CMakeLists):
# the macro that lets a training layer pick the backend by the linked target, and nvcc
# options the headers rely on (constexpr std:: functions in device code, lambdas).
function(concerto_nccl_target_extras target)
  target_compile_definitions(${target} INTERFACE CONCERTO_BACKEND_NCCL=1)
  if(NOT CONCERTO_HAS_CUDA)
    return()
  endif()
  target_compile_options(${target} INTERFACE
    $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr --extended-lambda>)
  target_compile_features(${target} INTERFACE cuda_std_20)
  # cuDNN's fused attention where its frontend was found (an empty target where not).
  target_link_libraries(${target} INTERFACE concerto_cudnn_frontend)
endfunction()

# Compiles every C++ source of a target with nvcc (the backend headers hold CUDA kernels).
function(concerto_cuda_sources target)
  get_target_property(sources ${target} SOURCES)
  foreach(source IN LISTS sources)
    if(source MATCHES "\\.(cpp|cc|cxx)$")
      set_source_files_properties(${source} TARGET_DIRECTORY ${target} PROPERTIES LANGUAGE CUDA)
    endif()
  endforeach()
endfunction()

set(CONCERTO_HAS_CUDA OFF)
if(NOT CONCERTO_HAS_NCCL)
  message(STATUS "concerto: CUDA Toolkit or NCCL not found, the GPU backend is not built")
  return()
endif()

include(CheckLanguage)
# CMake 3.25 knows no C++20 flags for nvcc; they must exist before enable_language.
if(NOT DEFINED CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
  set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
  set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
endif()
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  # sm_90 for Hopper (H100/H200, what the bench runs on), sm_80 as the portable default.
  set(CMAKE_CUDA_ARCHITECTURES 80 90)
endif()
if(NOT CMAKE_CUDA_COMPILER)
  check_language(CUDA)
endif()
if(NOT CMAKE_CUDA_COMPILER)
  message(STATUS "concerto: nvcc not found, the GPU backend is not built")
  return()
endif()
if(NOT CMAKE_CUDA_HOST_COMPILER)
  set(CMAKE_CUDA_HOST_COMPILER ${CMAKE_CXX_COMPILER})
endif()
enable_language(CUDA)
set(CONCERTO_HAS_CUDA ON)

