# Finds what concerto needs and makes imported targets for the libraries that ship
# no CMake package on Debian (Z3, CBC, NCCL). Used by the build and by the installed
# concertoConfig.cmake, so that consumers resolve the same way.
include(CMakeFindDependencyMacro)

find_dependency(nlohmann_json 3.10)
find_dependency(range-v3)
find_dependency(Threads)
find_dependency(MPI COMPONENTS CXX)

# Z3: Debian ships a pkg-config file and no CMake config.
find_dependency(PkgConfig)
if(NOT TARGET concerto_z3)
  pkg_check_modules(CONCERTO_Z3 REQUIRED IMPORTED_TARGET z3)
  add_library(concerto_z3 INTERFACE)
  target_link_libraries(concerto_z3 INTERFACE PkgConfig::CONCERTO_Z3)
endif()

# COIN-OR CBC, the integer-program solver of automatic sharding's exact formulation
# (autoshard/formulation.hpp): Debian ships a pkg-config file and no CMake config.
if(NOT TARGET concerto_cbc)
  pkg_check_modules(CONCERTO_CBC REQUIRED IMPORTED_TARGET cbc)
  add_library(concerto_cbc INTERFACE)
  target_link_libraries(concerto_cbc INTERFACE PkgConfig::CONCERTO_CBC)
endif()

# BLAS with the CBLAS interface (OpenBLAS on Debian) for the CPU kernels.
if(NOT TARGET concerto_blas)
  find_dependency(BLAS)
  find_path(CONCERTO_CBLAS_INCLUDE_DIR cblas.h PATH_SUFFIXES openblas x86_64-linux-gnu)
  if(NOT CONCERTO_CBLAS_INCLUDE_DIR)
    message(FATAL_ERROR "concerto: cblas.h not found; install a CBLAS (Debian: libopenblas-dev)")
  endif()
  add_library(concerto_blas INTERFACE)
  target_link_libraries(concerto_blas INTERFACE BLAS::BLAS)
  target_include_directories(concerto_blas INTERFACE ${CONCERTO_CBLAS_INCLUDE_DIR})
endif()

# CUDA Toolkit, NCCL and cuDNN are optional: without them the GPU target is not defined.
# (cuDNN runs the convolutions, runtime/cuda/convolution.hpp; it installs beside the toolkit.)
set(CONCERTO_HAS_NCCL OFF)
find_package(CUDAToolkit QUIET)
if(CUDAToolkit_FOUND)
  find_library(CONCERTO_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} ${CUDAToolkit_LIBRARY_ROOT}/lib64)
  find_path(CONCERTO_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
  find_library(CONCERTO_CUDNN_LIBRARY cudnn HINTS ${CUDAToolkit_LIBRARY_DIR} ${CUDAToolkit_LIBRARY_ROOT}/lib64)
  find_path(CONCERTO_CUDNN_INCLUDE_DIR cudnn.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
  if(CONCERTO_NCCL_LIBRARY AND CONCERTO_NCCL_INCLUDE_DIR AND CONCERTO_CUDNN_LIBRARY AND CONCERTO_CUDNN_INCLUDE_DIR)
    if(NOT TARGET concerto_nccl_lib)
      add_library(concerto_nccl_lib UNKNOWN IMPORTED)
      set_target_properties(concerto_nccl_lib PROPERTIES
        IMPORTED_LOCATION ${CONCERTO_NCCL_LIBRARY}
        INTERFACE_INCLUDE_DIRECTORIES ${CONCERTO_NCCL_INCLUDE_DIR})
      add_library(concerto_cudnn_lib UNKNOWN IMPORTED)
      set_target_properties(concerto_cudnn_lib PROPERTIES
        IMPORTED_LOCATION ${CONCERTO_CUDNN_LIBRARY}
        INTERFACE_INCLUDE_DIRECTORIES ${CONCERTO_CUDNN_INCLUDE_DIR})
    endif()
    set(CONCERTO_HAS_NCCL ON)
    # cuDNN's frontend, header-only (scripts/deps.sh unpacks it from PyPI): the fused attention of
    # runtime/cuda/cudnn_attention.hpp. Optional; without it the GPU attention runs its own kernels.
    # An imported target, so its headers are SYSTEM ones (they must not trip -Werror) and the
    # installed package resolves it again on the consumer's machine; nvcc's sources only (the
    # host-compiled sources of concerto::nccl and the emulated GPU tests never see it).
    find_path(CONCERTO_CUDNN_FRONTEND_INCLUDE_DIR cudnn_frontend.h HINTS /opt/concerto/cudnn-frontend/include
              DOC "Directory of cuDNN's frontend headers (cudnn_frontend.h)")
    if(NOT TARGET concerto_cudnn_frontend)
      add_library(concerto_cudnn_frontend INTERFACE IMPORTED)
      if(CONCERTO_CUDNN_FRONTEND_INCLUDE_DIR)
        set_target_properties(concerto_cudnn_frontend PROPERTIES
          INTERFACE_INCLUDE_DIRECTORIES "$<$<COMPILE_LANGUAGE:CUDA>:${CONCERTO_CUDNN_FRONTEND_INCLUDE_DIR}>"
          INTERFACE_COMPILE_DEFINITIONS "$<$<COMPILE_LANGUAGE:CUDA>:CONCERTO_HAS_CUDNN_FRONTEND=1>"
          # The frontend's graphs can compile engines at run time (its experimental SM100 ones).
          INTERFACE_LINK_LIBRARIES CUDA::nvrtc)
      else()
        message(STATUS "concerto: cuDNN frontend headers not found (scripts/deps.sh installs them), the GPU attention runs its own kernels only")
      endif()
    endif()
  elseif(NOT CONCERTO_CUDNN_LIBRARY OR NOT CONCERTO_CUDNN_INCLUDE_DIR)
    message(STATUS "concerto: cuDNN not found beside the CUDA Toolkit, the GPU backend is not built")
  endif()
endif()
