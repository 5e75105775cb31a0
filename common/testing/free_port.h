// For tests and benchmarks that start servers: a loopback TCP port nothing listens on now (a
// socket bound to port 0, the port it got read back, the socket released). 0 when no socket
// could be bound. Another process may take the port before the caller does: callers that can
// pass port 0 to the server itself should.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>

namespace strata {

inline uint16_t FreeLoopbackPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
                  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  close(fd);
  return ok ? ntohs(a.sin_port) : 0;
}

// Whether `port` on loopback can be bound now.
inline bool LoopbackPortIsFree(uint16_t port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(port);
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  close(fd);
  return ok;
}

// A free loopback port p in [10000, 55000) whose p + `offset` is free too (Redis Cluster's bus
// port is the client port + 10000: an ephemeral port from FreeLoopbackPort may leave no room
// for it). 0 when none was found in a bounded search.
inline uint16_t FreeLoopbackPortWithPartner(uint16_t offset) {
  static uint32_t next = 10000 + static_cast<uint32_t>(getpid()) * 7919 % 40000;
  for (int tries = 0; tries < 2000; ++tries) {
    next = 10000 + (next + 37 - 10000) % 45000;
    const uint16_t p = static_cast<uint16_t>(next);
    if (LoopbackPortIsFree(p) && LoopbackPortIsFree(static_cast<uint16_t>(p + offset))) return p;
  }
  return 0;
}

}  // namespace strata
