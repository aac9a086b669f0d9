#pragma once
// Stands in for NCCL's nccl.h in the emulated test targets: communicators over MPI, so that the
// NCCL backend runs on CPU ranks (mpirun) against the host emulation of CUDA.
//
// A communicator is an MPI communicator of its members (the root named in the unique id
// gathers them over MPI_COMM_WORLD; ranks outside take no part).
// Collectives run when their stream work runs (see cuda_emulation.hpp): gathered over MPI, then
// reduced on each rank in rank order. NCCL's rules for buffers are checked: in-place forms only
// at the offsets NCCL defines (all-gather: send = recv + rank·count; reduce-scatter:
// recv = send + rank·count), otherwise send and receive buffers must not overlap. Calls between
// ncclGroupStart and ncclGroupEnd are issued together at the end, as NCCL does.
#include "../cuda_emulation.hpp"
#include "cuda_bf16.h"
#include "cuda_fp16.h"

#include <mpi.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#define NCCL_MAJOR 2
#define NCCL_MINOR 28
#define NCCL_PATCH 9
#define NCCL_VERSION(X, Y, Z) (((X) <= 2 && (Y) <= 8) ? (X) * 1000 + (Y) * 100 + (Z) : (X) * 10000 + (Y) * 100 + (Z))
#define NCCL_VERSION_CODE NCCL_VERSION(NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH)

enum ncclResult_t {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
};
enum ncclDataType_t {
  ncclInt8 = 0, ncclUint8 = 1, ncclInt32 = 2, ncclUint32 = 3, ncclInt64 = 4, ncclUint64 = 5,
  ncclFloat16 = 6, ncclFloat32 = 7, ncclFloat64 = 8, ncclBfloat16 = 9,
  ncclChar = ncclInt8, ncclInt = ncclInt32, ncclHalf = ncclFloat16, ncclFloat = ncclFloat32, ncclDouble = ncclFloat64,
};
enum ncclRedOp_t { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4 };

struct ncclUniqueId {
  char internal[128];
};
struct ncclConfig_t {
  std::size_t size;
  unsigned magic, version;
  int blocking, cgaClusterSize, minCTAs, maxCTAs;
  const char* netName;
  int splitShare, trafficClass;
  const char* commName;
  int collnetEnable, CTAPolicy, shrinkShare, nvlsCTAs;
};
#define NCCL_CONFIG_UNDEF_INT INT32_MIN
#define NCCL_CONFIG_INITIALIZER                                                                                    \
  {sizeof(ncclConfig_t), 0xcafebeef, NCCL_VERSION_CODE, NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT,             \
   NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT, nullptr, NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT, nullptr,  \
   NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT}

struct ncclComm {
  MPI_Comm mpi = MPI_COMM_NULL;
  int rank = 0, size = 1;
};
using ncclComm_t = ncclComm*;

namespace cuda_emulation::nccl {

inline thread_local std::string last_error;
inline ncclResult_t refuse(ncclResult_t r, std::string why) {
  last_error = std::move(why);
  return r;
}

inline std::size_t bytes_of(ncclDataType_t t) {
  switch (t) {
  case ncclInt8: case ncclUint8: return 1;
  case ncclFloat16: case ncclBfloat16: return 2;
  case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
  case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
  }
  return 0;
}

// Reads element i of a buffer of type t as double (exact for every type but 64-bit integers
// beyond 2^53, which the backend never reduces).
inline double load(const std::byte* p, ncclDataType_t t, std::size_t i) {
  switch (t) {
  case ncclInt8: return static_cast<double>(reinterpret_cast<const std::int8_t*>(p)[i]);
  case ncclUint8: return static_cast<double>(reinterpret_cast<const std::uint8_t*>(p)[i]);
  case ncclInt32: return static_cast<double>(reinterpret_cast<const std::int32_t*>(p)[i]);
  case ncclUint32: return static_cast<double>(reinterpret_cast<const std::uint32_t*>(p)[i]);
  case ncclInt64: return static_cast<double>(reinterpret_cast<const std::int64_t*>(p)[i]);
  case ncclUint64: return static_cast<double>(reinterpret_cast<const std::uint64_t*>(p)[i]);
  case ncclFloat32: return reinterpret_cast<const float*>(p)[i];
  case ncclFloat64: return reinterpret_cast<const double*>(p)[i];
  case ncclBfloat16: return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(p)[i]);
  case ncclFloat16: return __half2float(reinterpret_cast<const __half*>(p)[i]);
  }
  throw std::logic_error("NCCL emulation: an unknown data type");
}
inline void store(std::byte* p, ncclDataType_t t, std::size_t i, double v) {
  switch (t) {
  case ncclInt8: reinterpret_cast<std::int8_t*>(p)[i] = static_cast<std::int8_t>(v); return;
  case ncclUint8: reinterpret_cast<std::uint8_t*>(p)[i] = static_cast<std::uint8_t>(v); return;
  case ncclInt32: reinterpret_cast<std::int32_t*>(p)[i] = static_cast<std::int32_t>(v); return;
  case ncclUint32: reinterpret_cast<std::uint32_t*>(p)[i] = static_cast<std::uint32_t>(v); return;
  case ncclInt64: reinterpret_cast<std::int64_t*>(p)[i] = static_cast<std::int64_t>(v); return;
  case ncclUint64: reinterpret_cast<std::uint64_t*>(p)[i] = static_cast<std::uint64_t>(v); return;
  case ncclFloat32: reinterpret_cast<float*>(p)[i] = static_cast<float>(v); return;
  case ncclFloat64: reinterpret_cast<double*>(p)[i] = v; return;
  case ncclBfloat16: reinterpret_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16(static_cast<float>(v)); return;
  case ncclFloat16: reinterpret_cast<__half*>(p)[i] = __float2half(static_cast<float>(v)); return;
  }
  throw std::logic_error("NCCL emulation: an unknown data type");
}

// Every rank's `bytes` from `send`, in rank order.
inline std::vector<std::byte> gather(const ncclComm& c, const void* send, std::size_t bytes) {
  std::vector<std::byte> all(bytes * static_cast<std::size_t>(c.size));
  if (bytes > 0) MPI_Allgather(send, static_cast<int>(bytes), MPI_BYTE, all.data(), static_cast<int>(bytes), MPI_BYTE, c.mpi);
  return all;
}
// The float types whose sums are fp32 sums.
inline bool is_float32_sum(ncclDataType_t t) { return t == ncclFloat32 || t == ncclBfloat16 || t == ncclFloat16; }
// Elements [first, first + count) reduced over the ranks' blocks of `block` elements, in rank
// order (float types in fp32 as NCCL does, then stored in the buffer's type).
inline void reduce(const ncclComm& c, const std::vector<std::byte>& all, std::size_t block, std::size_t first,
                   std::size_t count, ncclDataType_t t, ncclRedOp_t op, std::byte* out) {
  const std::size_t block_bytes = block * bytes_of(t);
  for (std::size_t i = 0; i < count; ++i) {
    double acc = load(all.data(), t, first + i);
    for (int r = 1; r < c.size; ++r) {
      const double v = load(all.data() + static_cast<std::size_t>(r) * block_bytes, t, first + i);
      switch (op) {
      case ncclSum: case ncclAvg: acc = is_float32_sum(t) ? static_cast<float>(acc) + static_cast<float>(v) : acc + v; break;
      case ncclProd: acc *= v; break;
      case ncclMax: acc = v > acc ? v : acc; break;
      case ncclMin: acc = v < acc ? v : acc; break;
      }
    }
    if (op == ncclAvg) acc /= c.size;
    store(out, t, i, acc);
  }
}

using cuda_emulation::overlap;

// Point-to-point calls of an open group, matched by MPI at ncclGroupEnd.
struct p2p {
  bool send;
  void* buffer;
  std::size_t bytes;
  int peer;
  ncclComm_t comm;
};
struct group_state {
  int depth = 0;
  std::vector<std::function<void()>> collectives;
  std::vector<p2p> p2p_calls;
};
inline thread_local group_state group;

// Issues `work` now (through the stream emulation) or at the end of the open group.
inline void issue(std::function<void()> work) {
  if (group.depth > 0) group.collectives.push_back(std::move(work));
  else cuda_emulation::enqueue(std::move(work));
}

// A lone send or receive: posted when its stream reaches it, pending there until it completes.
inline ncclResult_t post(p2p call, cudaStream_t s) {
  cuda_emulation::enqueue([call, s] {
    auto request = std::make_shared<MPI_Request>(MPI_REQUEST_NULL);
    if (call.send)
      MPI_Isend(call.buffer, static_cast<int>(call.bytes), MPI_BYTE, call.peer, 0, call.comm->mpi, request.get());
    else
      MPI_Irecv(call.buffer, static_cast<int>(call.bytes), MPI_BYTE, call.peer, 0, call.comm->mpi, request.get());
    cuda_emulation::add_pending(s, [request](bool wait) {
      if (wait) {
        MPI_Wait(request.get(), MPI_STATUS_IGNORE);
        return true;
      }
      int done = 0;
      MPI_Test(request.get(), &done, MPI_STATUS_IGNORE);
      return done != 0;
    });
  });
  return ncclSuccess;
}

inline int next_id = 0;

} // namespace cuda_emulation::nccl

inline const char* ncclGetErrorString(ncclResult_t r) {
  switch (r) {
  case ncclSuccess: return "no error";
  case ncclUnhandledCudaError: return "unhandled cuda error";
  case ncclSystemError: return "unhandled system error";
  case ncclInternalError: return "internal error";
  case ncclInvalidArgument: return "invalid argument";
  case ncclInvalidUsage: return "invalid usage";
  case ncclRemoteError: return "remote process exited or there was a network error";
  case ncclInProgress: return "NCCL operation in progress";
  }
  return "unknown result code";
}
inline const char* ncclGetLastError(ncclComm_t) { return cuda_emulation::nccl::last_error.c_str(); }

inline ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  int world_rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  std::memset(id, 0, sizeof *id);
  const int colour[2] = {world_rank, cuda_emulation::nccl::next_id++};
  std::memcpy(id->internal, colour, sizeof colour);
  return ncclSuccess;
}
// The members find each other through the root named in the id, over MPI_COMM_WORLD, then make
// their communicator with MPI_Comm_create_group, which only they call.
inline ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank, ncclConfig_t*) {
  namespace em = cuda_emulation::nccl;
  int root_and_serial[2];
  std::memcpy(root_and_serial, id.internal, sizeof root_and_serial);
  const int root = root_and_serial[0], tag = 0x4000 + root_and_serial[1] % 0x1000;
  int me = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  if (nranks < 1 || rank < 0 || rank >= nranks || (rank == 0) != (me == root))
    return em::refuse(ncclInvalidArgument, "NCCL emulation: rank 0 of a communicator must be the rank that made its unique id");
  std::vector<int> members(static_cast<std::size_t>(nranks));
  if (rank == 0) {
    members[0] = me;
    for (int i = 1; i < nranks; ++i) {
      int who[2];
      MPI_Recv(who, 2, MPI_INT, MPI_ANY_SOURCE, tag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      members.at(static_cast<std::size_t>(who[0])) = who[1];
    }
    for (int i = 1; i < nranks; ++i)
      MPI_Send(members.data(), nranks, MPI_INT, members[static_cast<std::size_t>(i)], tag, MPI_COMM_WORLD);
  } else {
    const int who[2] = {rank, me};
    MPI_Send(who, 2, MPI_INT, root, tag, MPI_COMM_WORLD);
    MPI_Recv(members.data(), nranks, MPI_INT, root, tag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  }
  MPI_Group world = MPI_GROUP_NULL, group = MPI_GROUP_NULL;
  MPI_Comm_group(MPI_COMM_WORLD, &world);
  MPI_Group_incl(world, nranks, members.data(), &group);
  auto c = std::make_unique<ncclComm>();
  MPI_Comm_create_group(MPI_COMM_WORLD, group, tag, &c->mpi);
  MPI_Group_free(&group);
  MPI_Group_free(&world);
  MPI_Comm_rank(c->mpi, &c->rank);
  MPI_Comm_size(c->mpi, &c->size);
  *comm = c.release();
  return ncclSuccess;
}
inline ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
  return ncclCommInitRankConfig(comm, nranks, id, rank, nullptr);
}
inline ncclResult_t ncclCommGetAsyncError(ncclComm_t, ncclResult_t* r) {
  *r = ncclSuccess;
  return ncclSuccess;
}
inline ncclResult_t ncclCommFinalize(ncclComm_t) { return ncclSuccess; }
inline ncclResult_t ncclCommDestroy(ncclComm_t c) {
  if (c == nullptr) return ncclSuccess;
  MPI_Comm_free(&c->mpi);
  delete c;
  return ncclSuccess;
}
inline ncclResult_t ncclCommAbort(ncclComm_t c) { return ncclCommDestroy(c); }
inline ncclResult_t ncclCommCount(const ncclComm_t c, int* n) {
  *n = c->size;
  return ncclSuccess;
}
inline ncclResult_t ncclCommUserRank(const ncclComm_t c, int* r) {
  *r = c->rank;
  return ncclSuccess;
}

inline ncclResult_t ncclAllReduce(const void* send, void* recv, std::size_t count, ncclDataType_t t, ncclRedOp_t op,
                                  ncclComm_t c, cudaStream_t) {
  namespace em = cuda_emulation::nccl;
  const std::size_t bytes = count * em::bytes_of(t);
  if (send != recv && em::overlap(send, bytes, recv, bytes))
    return em::refuse(ncclInvalidArgument, "ncclAllReduce: send and receive buffers overlap without being one buffer");
  em::issue([=] {
    const auto all = em::gather(*c, send, bytes);
    em::reduce(*c, all, count, 0, count, t, op, static_cast<std::byte*>(recv));
  });
  return ncclSuccess;
}
inline ncclResult_t ncclReduceScatter(const void* send, void* recv, std::size_t recvcount, ncclDataType_t t,
                                      ncclRedOp_t op, ncclComm_t c, cudaStream_t) {
  namespace em = cuda_emulation::nccl;
  const std::size_t part = recvcount * em::bytes_of(t), whole = part * static_cast<std::size_t>(c->size);
  const bool in_place = recv == static_cast<const std::byte*>(send) + static_cast<std::size_t>(c->rank) * part;
  if (!in_place && em::overlap(send, whole, recv, part))
    return em::refuse(ncclInvalidArgument, "ncclReduceScatter: the receive buffer overlaps the send buffer away from "
                                           "recvbuff = sendbuff + rank * recvcount (NCCL's in-place form)");
  em::issue([=] {
    const auto all = em::gather(*c, send, whole);
    em::reduce(*c, all, recvcount * static_cast<std::size_t>(c->size), static_cast<std::size_t>(c->rank) * recvcount,
               recvcount, t, op, static_cast<std::byte*>(recv));
  });
  return ncclSuccess;
}
inline ncclResult_t ncclAllGather(const void* send, void* recv, std::size_t sendcount, ncclDataType_t t, ncclComm_t c,
                                  cudaStream_t) {
  namespace em = cuda_emulation::nccl;
  const std::size_t part = sendcount * em::bytes_of(t), whole = part * static_cast<std::size_t>(c->size);
  const bool in_place = send == static_cast<const std::byte*>(recv) + static_cast<std::size_t>(c->rank) * part;
  if (!in_place && em::overlap(send, part, recv, whole))
    return em::refuse(ncclInvalidArgument, "ncclAllGather: the send buffer overlaps the receive buffer away from "
                                           "sendbuff = recvbuff + rank * sendcount (NCCL's in-place form)");
  em::issue([=] {
    const auto all = em::gather(*c, send, part);
    if (whole > 0) std::memcpy(recv, all.data(), whole);
  });
  return ncclSuccess;
}
inline ncclResult_t ncclBroadcast(const void* send, void* recv, std::size_t count, ncclDataType_t t, int root,
                                  ncclComm_t c, cudaStream_t) {
  namespace em = cuda_emulation::nccl;
  const std::size_t bytes = count * em::bytes_of(t);
  if (root < 0 || root >= c->size) return em::refuse(ncclInvalidArgument, "ncclBroadcast: root outside the communicator");
  if (send != recv && c->rank == root && em::overlap(send, bytes, recv, bytes))
    return em::refuse(ncclInvalidArgument, "ncclBroadcast: send and receive buffers overlap without being one buffer");
  em::issue([=] {
    if (c->rank == root && send != recv && bytes > 0) std::memcpy(recv, send, bytes);
    if (bytes > 0) MPI_Bcast(recv, static_cast<int>(bytes), MPI_BYTE, root, c->mpi);
  });
  return ncclSuccess;
}
inline ncclResult_t ncclAlltoAll(const void* send, void* recv, std::size_t count, ncclDataType_t t, ncclComm_t c,
                                 cudaStream_t) {
  namespace em = cuda_emulation::nccl;
  const std::size_t part = count * em::bytes_of(t), whole = part * static_cast<std::size_t>(c->size);
  if (em::overlap(send, whole, recv, whole))
    return em::refuse(ncclInvalidArgument, "ncclAlltoAll: send and receive buffers overlap");
  em::issue([=] {
    if (part > 0)
      MPI_Alltoall(send, static_cast<int>(part), MPI_BYTE, recv, static_cast<int>(part), MPI_BYTE, c->mpi);
  });
  return ncclSuccess;
}
// Inside a group, a send or receive waits for the group's end. Alone, it is posted when its
// stream reaches it and completes later (cuda_emulation.hpp: pending on its stream), as NCCL's
// hold their stream, not the host: a receive posted early must not stop this rank's host from
// issuing the work its peer waits for.
inline ncclResult_t ncclSend(const void* send, std::size_t count, ncclDataType_t t, int peer, ncclComm_t c, cudaStream_t s) {
  namespace em = cuda_emulation::nccl;
  if (em::group.depth == 0) return em::post({true, const_cast<void*>(send), count * em::bytes_of(t), peer, c}, s);
  em::group.p2p_calls.push_back({true, const_cast<void*>(send), count * em::bytes_of(t), peer, c});
  return ncclSuccess;
}
inline ncclResult_t ncclRecv(void* recv, std::size_t count, ncclDataType_t t, int peer, ncclComm_t c, cudaStream_t s) {
  namespace em = cuda_emulation::nccl;
  if (em::group.depth == 0) return em::post({false, recv, count * em::bytes_of(t), peer, c}, s);
  em::group.p2p_calls.push_back({false, recv, count * em::bytes_of(t), peer, c});
  return ncclSuccess;
}
inline ncclResult_t ncclGroupStart() {
  ++cuda_emulation::nccl::group.depth;
  return ncclSuccess;
}
inline ncclResult_t ncclGroupEnd() {
  namespace em = cuda_emulation::nccl;
  if (em::group.depth == 0) return em::refuse(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
  if (--em::group.depth > 0) return ncclSuccess;
  auto collectives = std::move(em::group.collectives);
  auto calls = std::move(em::group.p2p_calls);
  em::group = {};
  cuda_emulation::enqueue([collectives = std::move(collectives), calls = std::move(calls)] {
    std::vector<MPI_Request> requests;
    for (const auto& p : calls) {
      requests.emplace_back();
      if (p.send)
        MPI_Isend(p.buffer, static_cast<int>(p.bytes), MPI_BYTE, p.peer, 0, p.comm->mpi, &requests.back());
      else
        MPI_Irecv(p.buffer, static_cast<int>(p.bytes), MPI_BYTE, p.peer, 0, p.comm->mpi, &requests.back());
    }
    MPI_Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE);
    for (const auto& work : collectives) work();
  });
  return ncclSuccess;
}
