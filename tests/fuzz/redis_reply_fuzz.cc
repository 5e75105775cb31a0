// libFuzzer target for what Strata reads from Redis: any bytes, as a server's replies on a
// connection (RedisConnection over a socket pair), read reply after reply, alternately with large
// bulk strings read straight into aligned buffers and through hiredis's parser alone, give replies
// or a clear error, never a crash or a hang; a value read straight has the length its header said.
#include <sys/socket.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <thread>

#include "absl/time/clock.h"
#include "kvstore/redis_connection.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using strata::kvstore::RedisConnection;
  int fds[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, fds) != 0) return 0;
  std::unique_ptr<RedisConnection> conn =
      RedisConnection::FromSocket(fds[0], "fuzz", absl::Seconds(5));
  // The writer ends the stream, so every read ends: with a reply, or at the end, with an error.
  std::thread writer([fd = fds[1], data, size] {
    for (size_t at = 0; at < size;) {
      const ssize_t n = send(fd, data + at, size - at, MSG_NOSIGNAL);
      if (n <= 0) break;
      at += static_cast<size_t>(n);
    }
    close(fd);
  });
  for (size_t i = 0; i <= size; ++i) {  // each reply takes at least one byte
    absl::StatusOr<strata::kvstore::RedisDirectReply> r =
        conn->ReadReply(absl::Now() + absl::Seconds(10), i % 2 == 0);
    if (!r.ok()) {
      if (r.status().message().empty()) __builtin_trap();
      break;
    }
    if ((r->parsed == nullptr) == !r->bulk.has_value()) __builtin_trap();  // exactly one
    if (r->bulk.has_value() && r->bulk->size() < RedisConnection::kDirectBulk) __builtin_trap();
  }
  conn.reset();  // closes its end: a writer blocked on a full socket returns
  writer.join();
  return 0;
}
