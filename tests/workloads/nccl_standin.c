/* A stand-in for what NCCL does with its node's address (no NCCL without a GPU): the first call
 * picks the first non-loopback IPv4 interface and keeps its address in a static variable, as
 * NCCL's bootstrapNetInit keeps bootstrapNetIfAddr; every listen binds to the kept address and
 * reads back what it bound, as ncclSocketListen does.  ncclGetVersion is defined so that the
 * rank runtime finds this library as it finds NCCL's.  Built by tests/agent/test_nccl_address.py. */
#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

/* NCCL's .bss is large: its address lies past the file's last page, in the part of the
 * segment the loader maps anonymous.  The pad puts this one there too. */
static struct {
  char pad[1 << 20];
  union {
    struct sockaddr sa;
    struct sockaddr_in sin;
    struct sockaddr_in6 sin6;
  } addr;
} kept;
static int kept_done = 0;

void *standin_kept(void) { return &kept.addr; }

int ncclGetVersion(int *version) {
  *version = 0;
  return 0;
}

/* 0, or -errno; the kept address into out ("ip") */
int standin_init(char *out, int n) {
  struct ifaddrs *all, *i;
  if (kept_done) return 0;
  if (getifaddrs(&all) != 0) return -errno;
  for (i = all; i != NULL; i = i->ifa_next) {
    if (i->ifa_addr == NULL || i->ifa_addr->sa_family != AF_INET || (i->ifa_flags & IFF_LOOPBACK)) continue;
    memcpy(&kept.addr.sin, i->ifa_addr, sizeof(struct sockaddr_in));
    kept_done = 1;
    break;
  }
  freeifaddrs(all);
  if (!kept_done) return -ENODEV;
  inet_ntop(AF_INET, &kept.addr.sin.sin_addr, out, n);
  return 0;
}

/* 0, or -errno; the bound address into out ("ip:port") */
int standin_listen(char *out, int n) {
  struct sockaddr_in bound;
  socklen_t len = sizeof(bound);
  char ip[INET_ADDRSTRLEN];
  int fd = socket(AF_INET, SOCK_STREAM, 0), err = 0;
  if (fd < 0) return -errno;
  if (bind(fd, &kept.addr.sa, sizeof(struct sockaddr_in)) != 0 || listen(fd, 1) != 0 ||
      getsockname(fd, (struct sockaddr *)&bound, &len) != 0)
    err = -errno;
  if (err == 0) {
    inet_ntop(AF_INET, &bound.sin_addr, ip, sizeof(ip));
    snprintf(out, n, "%s:%d", ip, ntohs(bound.sin_port));
  }
  close(fd);
  return err;
}
