/* graphdist loopback-only bind shim, loaded with LD_PRELOAD into fleet server processes.
 *
 * TensorFlow's gRPC server always binds the wildcard address (0.0.0.0 / [::]), whatever host the
 * cluster names, and has no authentication. This interposes bind(): a wildcard address becomes
 * the loopback address in GRAPHDIST_BIND_ADDR (default 127.0.0.1); the IPv6 wildcard becomes the
 * same address v4-mapped (::ffff:127.0.0.1), so IPv4 clients of "localhost" still connect.
 * Any other address is passed through unchanged.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

static struct in_addr loopback_addr(void) {
    struct in_addr out;
    const char *text = getenv("GRAPHDIST_BIND_ADDR");
    if (text == NULL || inet_pton(AF_INET, text, &out) != 1) {
        out.s_addr = htonl(INADDR_LOOPBACK);
    }
    return out;
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static bind_fn real_bind = NULL;
    if (real_bind == NULL) {
        real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    }
    if (addr != NULL && addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
        struct sockaddr_in a;
        memcpy(&a, addr, sizeof a);
        if (a.sin_addr.s_addr == htonl(INADDR_ANY)) {
            a.sin_addr = loopback_addr();
            return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
        }
    } else if (addr != NULL && addr->sa_family == AF_INET6 && len >= sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 a;
        memcpy(&a, addr, sizeof a);
        if (IN6_IS_ADDR_UNSPECIFIED(&a.sin6_addr)) {
            struct in_addr v4 = loopback_addr();
            memset(&a.sin6_addr, 0, sizeof a.sin6_addr);
            a.sin6_addr.s6_addr[10] = 0xff;
            a.sin6_addr.s6_addr[11] = 0xff;
            memcpy(&a.sin6_addr.s6_addr[12], &v4, 4);
            return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
        }
    }
    return real_bind(fd, addr, len);
}
