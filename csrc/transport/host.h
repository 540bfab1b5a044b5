// Which host a rank is on, and which machine: the definitions behind every "same host"
// choice. A host is what the network topology sees (shared memory inside, the network
// between); a machine is a kernel whose cores its processes share, whatever their namespaces.
#pragma once

#include <string>

namespace ddlcomm {

// DDLCOMM_HOST_ID when set (a name the user or a test gives the host: ranks with the same
// one are on one host), else this machine's boot id and network namespace: ranks in
// different network namespaces (containers, the emulated hosts of ddlcomm.slownet)
// are different hosts, as they reach each other only through a network. Throws
// InvalidArgument for a DDLCOMM_HOST_ID that is too long or holds spaces or control bytes.
std::string hostIdentity();

// This machine's boot id: the ranks with the same one share its cores (the emulated hosts
// of ddlcomm.slownet do).
std::string machineIdentity();

// Whether this machine has an RDMA device (InfiniBand or RoCE, as rdma-core lists them in
// /sys/class/infiniband): where UCX is worth it.
bool rdmaDevicePresent();

// Facts of this process that another must share to map its memory (same machine, user and
// pid namespace, user id), whatever the host identity says.
std::string kernelFacts();

}  // namespace ddlcomm
