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

}  // namespace strata
