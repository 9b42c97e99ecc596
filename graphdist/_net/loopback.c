/* graphdist loopback-only bind shim, loaded with LD_PRELOAD into fleet server processes.
 *
 * TensorFlow's gRPC server always binds the wildcard address (0.0.0.0 / [::]), whatever host the
 * cluster names, and has no authentication: whoever connects can run any op in it (read or write
 * any file the server's user can). This library closes that in four places:
 *
 * bind()     A wildcard address becomes the loopback address in GRAPHDIST_BIND_ADDR (default
 *            127.0.0.1). With an IPv4 value the IPv6 wildcard becomes the same address v4-mapped
 *            (::ffff:127.0.0.1), so IPv4 clients of "localhost" still connect; with an IPv6 value
 *            (::1) the IPv6 wildcard becomes that address and the IPv4 wildcard 127.0.0.1. Any
 *            other address is passed through unchanged. The variable is read at each bind, so a
 *            forked child may set it after the library was loaded.
 *
 * accept()   Loopback is shared by every user of the machine, so a TCP connection is only
 * accept4()  handed to the caller if the peer's socket belongs to the server's own user or to
 *            root. Root is allowed on purpose: it can read any process's memory and files anyway,
 *            so refusing it protects nothing, and root-run clients and health checks keep working.
 *            A refused connection is closed and the real accept called again, so the caller sees
 *            the next connection, or EAGAIN / blocks, exactly as if the refused one never came.
 *            The peer's socket (local address = our peer, remote address = us) is looked up with
 *            one sock_diag netlink request: a hash lookup, whatever the number of sockets. Where
 *            that cannot answer, or finds nothing for a local peer, its row is read from
 *            /proc/net/tcp and tcp6 (uid: column 8): slower, as printing them walks the kernel's
 *            whole socket hash table (~2 ms per accept here with 256k buckets, more with many
 *            sockets open). A socket with inode 0 was already closed by its owner (FIN_WAIT2,
 *            TIME_WAIT: the kernel then shows it as root's): its owner is unknown, so it is
 *            refused (else another user could connect, send a request and close before we look).
 *            A peer whose socket is not found is another machine (possible only when the server
 *            was told to listen on a real address) and is let through, unless its address is
 *            loopback or our own: then it is refused (said once on stderr if the kernel could not
 *            be asked at all). Only AF_INET/AF_INET6 TCP connections are checked.
 *
 * members    A server on a host address (GRAPHDIST_BIND_ADDR a real address, or "*": keep the
 *            wildcard) is reachable from other machines. With GRAPHDIST_ALLOW set, a peer from
 *            another machine is let in only if its address is in that comma-separated list of
 *            addresses and CIDR networks (the cluster's own hosts and what the user allowed); an
 *            empty list lets in no other machine, an unparsable entry matches nothing, and so
 *            does an entry that holds every IPv4 address however it is spelled (a /0,
 *            ::ffff:0:0/96, ::/80 ...). The entry "*" lets in every other machine: only
 *            graphdist's TLS gateway sets it, for its listeners on host addresses, which admit
 *            by certificate (parse_allow never produces it). Without GRAPHDIST_ALLOW no other
 *            machine is let in at all (fail closed: an environment that lost the list, a server
 *            bound to a host address by itself, GRAPHDIST_BIND_ADDR="*" alone). The list is read at each
 *            accept, so a forked child may set it. graphdist_members() lets the server's
 *            process check that this is in force.
 *
 * connect()  A session's cluster_def names the workers a server dials, so a client that may use
 *            one server could make it dial any other (a loopback-only fleet of the same user, a
 *            server that lets in only this host) and run ops there through it. With
 *            GRAPHDIST_DIAL set (comma-separated numeric "10.0.0.3:2222" / "[fd00::3]:2222":
 *            every address of every task of the server's cluster), a TCP (SOCK_STREAM) connect
 *            to an address and port not on the list fails with ECONNREFUSED, as if nothing
 *            listened there, and is logged; v4-mapped destinations compare as IPv4. The list is
 *            parsed once per value (again only when the variable changes: a forked server sets
 *            it after the library was loaded). A malformed list refuses every TCP connect (said
 *            once on stderr). Unset: nothing is checked (run tasks and Ray actors run user
 *            code, which may dial anything). Other families (AF_UNIX), UDP, and whatever does
 *            not go through libc's connect() (io_uring, a raw syscall, sendto with
 *            MSG_FASTOPEN) are not checked: TensorFlow's gRPC and file systems use connect().
 *            graphdist_dial() lets the server's process check that this is in force.
 *
 * the log    A refused peer, or a refused dial, is logged on stderr with its address, bounded
 *            whatever the peers (or the sessions) do: at most one line per address per
 *            LOG_INTERVAL_S (the last LOG_SLOTS addresses are remembered) and LOG_CAP lines per
 *            interval in all, both kinds together; the refusals left unsaid are counted in one
 *            line when the next interval starts.
 *
 * constructor  Removes this library from LD_PRELOAD (keeping the user's other entries) unless
 *            GRAPHDIST_SHIM_INHERIT=1, so the programs a server starts do not get the shim. The
 *            process itself keeps it: the library stays mapped, and fork() children share it. So
 *            a wrapper between whoever sets LD_PRELOAD and the server (sh -c, env, nice, strace)
 *            takes the shim away from the server unless GRAPHDIST_SHIM_INHERIT=1; bash, which
 *            replaces libc's unsetenv with its own, happens to pass it on.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);
typedef int (*accept_fn)(int, struct sockaddr *, socklen_t *);
typedef int (*accept4_fn)(int, struct sockaddr *, socklen_t *, int);
typedef int (*connect_fn)(int, const struct sockaddr *, socklen_t);

static bind_fn real_bind;
static accept_fn real_accept;
static accept4_fn real_accept4;
static connect_fn real_connect;

static void resolve(void) {
    if (real_bind == NULL) real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    if (real_accept == NULL) real_accept = (accept_fn)dlsym(RTLD_NEXT, "accept");
    if (real_accept4 == NULL) real_accept4 = (accept4_fn)dlsym(RTLD_NEXT, "accept4");
    if (real_connect == NULL) real_connect = (connect_fn)dlsym(RTLD_NEXT, "connect");
}

/* ---- bind ------------------------------------------------------------------------------- */

/* GRAPHDIST_BIND_ADDR as an IPv4 (returns AF_INET) or IPv6 (AF_INET6) address; 127.0.0.1 when
 * unset or unparsable; 0 for "*" (keep the wildcard: an exposed server, members only). */
static int loopback_addr(struct in_addr *v4, struct in6_addr *v6) {
    const char *text = getenv("GRAPHDIST_BIND_ADDR");
    if (text != NULL && strcmp(text, "*") == 0) return 0;
    if (text != NULL && inet_pton(AF_INET, text, v4) == 1) return AF_INET;
    if (text != NULL && inet_pton(AF_INET6, text, v6) == 1) return AF_INET6;
    v4->s_addr = htonl(INADDR_LOOPBACK);
    return AF_INET;
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    resolve();
    struct in_addr v4;
    struct in6_addr v6;
    if (addr != NULL && addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
        struct sockaddr_in a;
        memcpy(&a, addr, sizeof a);
        if (a.sin_addr.s_addr == htonl(INADDR_ANY)) {
            int family = loopback_addr(&v4, &v6);
            if (family == 0) return real_bind(fd, addr, len);
            if (family != AF_INET) v4.s_addr = htonl(INADDR_LOOPBACK);
            a.sin_addr = v4;
            return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
        }
    } else if (addr != NULL && addr->sa_family == AF_INET6 && len >= sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 a;
        memcpy(&a, addr, sizeof a);
        if (IN6_IS_ADDR_UNSPECIFIED(&a.sin6_addr)) {
            int family = loopback_addr(&v4, &v6);
            if (family == 0) return real_bind(fd, addr, len);
            if (family == AF_INET6) {
                a.sin6_addr = v6;
            } else { /* v4-mapped: ::ffff:a.b.c.d */
                memset(&a.sin6_addr, 0, sizeof a.sin6_addr);
                a.sin6_addr.s6_addr[10] = 0xff;
                a.sin6_addr.s6_addr[11] = 0xff;
                memcpy(&a.sin6_addr.s6_addr[12], &v4, 4);
            }
            return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
        }
    }
    return real_bind(fd, addr, len);
}

/* ---- accept: same user only ----------------------------------------------------------- */

/* Both ends of an accepted connection: as IPv4 where both are IPv4 or v4-mapped (v4 set), and
 * always as IPv6 (v4-mapped where need be). Ports in network byte order. */
struct ends {
    int v4;
    struct in_addr me4, peer4;
    struct in6_addr me6, peer6;
    in_port_t me_port, peer_port;
};

/* The owner of the peer's socket from the kernel's sock_diag netlink interface: one exact lookup
 * by address and port (a hash lookup, whatever the number of sockets). 1 found, 0 no such
 * socket (or only a listener on its port), -1 cannot ask (no netlink, no inet_diag module). */
static int diag_lookup(const struct ends *e, unsigned long *uid, unsigned long *inode) {
    struct {
        struct nlmsghdr nlh;
        struct inet_diag_req_v2 req;
    } msg;
    memset(&msg, 0, sizeof msg);
    msg.nlh.nlmsg_len = sizeof msg;
    msg.nlh.nlmsg_type = SOCK_DIAG_BY_FAMILY;
    msg.nlh.nlmsg_flags = NLM_F_REQUEST;
    msg.req.sdiag_family = e->v4 ? AF_INET : AF_INET6; /* AF_INET also finds v4-mapped sockets */
    msg.req.sdiag_protocol = IPPROTO_TCP;
    msg.req.idiag_states = ~0U;
    msg.req.id.idiag_sport = e->peer_port; /* the peer's socket: local = peer, remote = us */
    msg.req.id.idiag_dport = e->me_port;
    memcpy(msg.req.id.idiag_src, e->v4 ? (const void *)&e->peer4 : &e->peer6, e->v4 ? 4 : 16);
    memcpy(msg.req.id.idiag_dst, e->v4 ? (const void *)&e->me4 : &e->me6, e->v4 ? 4 : 16);
    msg.req.id.idiag_cookie[0] = msg.req.id.idiag_cookie[1] = INET_DIAG_NOCOOKIE;

    int nl = socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG), found = -1;
    if (nl < 0) return -1;
    long buf[1024]; /* aligned for nlmsghdr */
    ssize_t n = -1;
    if (send(nl, &msg, sizeof msg, 0) == (ssize_t)sizeof msg) {
        do n = recv(nl, buf, sizeof buf, MSG_DONTWAIT); /* the reply is queued by send() */
        while (n < 0 && errno == EINTR);
    }
    const struct nlmsghdr *h = (const struct nlmsghdr *)buf;
    if (n > 0 && NLMSG_OK(h, (size_t)n)) {
        if (h->nlmsg_type == SOCK_DIAG_BY_FAMILY &&
            h->nlmsg_len >= NLMSG_LENGTH(sizeof(struct inet_diag_msg))) {
            const struct inet_diag_msg *m = NLMSG_DATA(h);
            found = m->idiag_state != TCP_LISTEN;
            *uid = m->idiag_uid;
            *inode = m->idiag_inode;
        } else if (h->nlmsg_type == NLMSG_ERROR &&
                   h->nlmsg_len >= NLMSG_LENGTH(sizeof(struct nlmsgerr))) {
            /* ENOENT: no such socket, or no diag module for TCP: proc_lookup tells them apart */
            found = ((const struct nlmsgerr *)NLMSG_DATA(h))->error == -ENOENT ? 0 : -1;
        }
    }
    close(nl);
    return found;
}

/* An endpoint as the kernel prints it in /proc/net/tcp ("0100007F:1F90": the address's 32-bit
 * words in host byte order, then the port) and in /proc/net/tcp6 (four words). */
static void proc_v4(char out[16], const struct in_addr *a, in_port_t port) {
    snprintf(out, 16, "%08X:%04X", (unsigned)a->s_addr, (unsigned)ntohs(port));
}

static void proc_v6(char out[40], const struct in6_addr *a, in_port_t port) {
    uint32_t w[4];
    memcpy(w, a, sizeof w);
    snprintf(out, 40, "%08X%08X%08X%08X:%04X", (unsigned)w[0], (unsigned)w[1], (unsigned)w[2],
             (unsigned)w[3], (unsigned)ntohs(port));
}

/* One row: "  sl: LOCAL REMOTE st tx:rx tr:when retrnsmt uid timeout inode ...". */
static int match_row(const char *line, const char *local, const char *remote, size_t n,
                     unsigned long *uid, unsigned long *inode) {
    const char *p = strchr(line, ':');
    if (p == NULL) return 0; /* the header */
    for (p++; *p == ' '; p++) {}
    if (strncmp(p, local, n) != 0 || p[n] != ' ' || strncmp(p + n + 1, remote, n) != 0) return 0;
    p += 2 * n + 1;
    for (int field = 0; field < 4; field++) { /* st, tx:rx, tr:when, retrnsmt */
        for (; *p == ' '; p++) {}
        for (; *p != ' ' && *p != '\0'; p++) {}
    }
    char *end;
    *uid = strtoul(p, &end, 10);
    strtoul(end, &end, 10); /* timeout */
    *inode = strtoul(end, &end, 10);
    return 1;
}

/* Find the row for (local, remote) in table: 1 found, 0 not found, -1 unreadable. One open, a
 * read loop over a stack buffer, no stdio. */
static int find_row(const char *table, const char *local, const char *remote, unsigned long *uid,
                    unsigned long *inode) {
    int fd = open(table, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    char buf[16384];
    size_t have = 0, n = strlen(local);
    int found = 0, skipping = 0; /* skipping: the rest of an over-long line */
    for (;;) {
        ssize_t got = read(fd, buf + have, sizeof buf - 1 - have);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) {
            found = -1;
            break;
        }
        have += (size_t)got;
        buf[have] = '\0';
        char *line = buf, *nl;
        while ((nl = memchr(line, '\n', have - (size_t)(line - buf))) != NULL) {
            *nl = '\0';
            if (!skipping && match_row(line, local, remote, n, uid, inode)) {
                found = 1;
                break;
            }
            skipping = 0;
            line = nl + 1;
        }
        if (found || got == 0) {
            if (!found && !skipping && have > 0)
                found = match_row(line, local, remote, n, uid, inode); /* no final newline */
            break;
        }
        have -= (size_t)(line - buf);
        memmove(buf, line, have);
        if (have == sizeof buf - 1) { /* no row is this long: drop it */
            have = 0;
            skipping = 1;
        }
    }
    close(fd);
    return found;
}

/* The same answer from /proc/net/tcp (IPv4 client sockets) and /proc/net/tcp6 (IPv6 ones, v4
 * mapped too): slower (the kernel walks its whole socket hash table to print them), so only
 * where sock_diag cannot answer. */
static int proc_lookup(const struct ends *e, unsigned long *uid, unsigned long *inode) {
    char local[40], remote[40];
    proc_v6(local, &e->peer6, e->peer_port), proc_v6(remote, &e->me6, e->me_port);
    int found = find_row("/proc/net/tcp6", local, remote, uid, inode);
    if (found != 1 && e->v4) {
        proc_v4(local, &e->peer4, e->peer_port), proc_v4(remote, &e->me4, e->me_port);
        int again = find_row("/proc/net/tcp", local, remote, uid, inode);
        found = again == 1 || found == -1 ? again : found;
    }
    return found;
}

static void map_v4(struct in6_addr *out, const struct in_addr *a) {
    memset(out, 0, sizeof *out);
    out->s6_addr[10] = out->s6_addr[11] = 0xff;
    memcpy(&out->s6_addr[12], a, 4);
}

/* ---- members only: which other machines may connect ---------------------------------------- */

/* Whether the first `bits` bits of a and b are the same. */
static int same_prefix(const struct in6_addr *a, const struct in6_addr *b, long bits) {
    for (long i = 0; i < 16; i++) {
        long keep = bits - 8 * i; /* bits of byte i that must match */
        if (keep <= 0) break;
        unsigned char mask = keep >= 8 ? 0xff : (unsigned char)(0xff << (8 - keep));
        if ((a->s6_addr[i] & mask) != (b->s6_addr[i] & mask)) return 0;
    }
    return 1;
}

/* Whether the 16-byte address `peer` (IPv6, v4-mapped for IPv4) lies in the entry `text`
 * ("10.0.0.3", "10.0.0.0/24", "fd00::/64"): 1 yes, 0 no, -1 unparsable or holding every IPv4
 * address (matches nothing). */
static int in_entry(const char *text, size_t n, const struct in6_addr *peer) {
    char buf[64];
    if (n == 0 || n >= sizeof buf) return -1;
    memcpy(buf, text, n);
    buf[n] = '\0';
    char *slash = strchr(buf, '/');
    long bits = -1;
    if (slash != NULL) {
        char *end;
        *slash = '\0';
        if (slash[1] == '\0') return -1;
        bits = strtol(slash + 1, &end, 10);
        if (*end != '\0' || bits < 0) return -1;
    }
    struct in6_addr net;
    struct in_addr v4;
    if (inet_pton(AF_INET, buf, &v4) == 1) {
        if (bits > 32) return -1;
        map_v4(&net, &v4);
        bits = bits < 0 ? 128 : bits + 96;
    } else if (inet_pton(AF_INET6, buf, &net) == 1) {
        if (bits > 128) return -1;
        bits = bits < 0 ? 128 : bits;
    } else {
        return -1;
    }
    /* A network that holds every IPv4 address lets in every IPv4 machine: parse_allow refuses
     * it, and so does the matcher, which sees IPv4 as ::ffff:0:0/96. */
    static const struct in6_addr all_v4 = {{{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0, 0, 0, 0}}};
    if (bits <= 96 && same_prefix(&all_v4, &net, bits)) return -1;
    return same_prefix(peer, &net, bits);
}

/* Walk GRAPHDIST_ALLOW: the number of entries (-1 if one is unparsable, -2 if unset); with
 * `peer`, whether it is in one of them (*hit). */
static int walk_members(const struct in6_addr *peer, int *hit) {
    const char *list = getenv("GRAPHDIST_ALLOW");
    if (list == NULL) return -2;
    int count = 0, bad = 0;
    struct in6_addr none;
    memset(&none, 0, sizeof none);
    for (const char *p = list; *p != '\0';) {
        const char *end = strchr(p, ',');
        size_t n = end != NULL ? (size_t)(end - p) : strlen(p);
        if (n == 1 && *p == '*') { /* every machine: a TLS gateway's listener (see header) */
            count++;
            if (peer != NULL && hit != NULL) *hit = 1;
        } else if (n > 0) {
            int in = in_entry(p, n, peer != NULL ? peer : &none);
            if (in < 0) bad = 1;
            else count++;
            if (in == 1 && peer != NULL && hit != NULL) *hit = 1;
        }
        p += n + (end != NULL);
    }
    return bad ? -1 : count;
}

/* For graphdist's own check that the list is in force in this process (see members.py): the
 * number of entries in GRAPHDIST_ALLOW, -1 if one is unparsable, -2 if it is not set. */
__attribute__((visibility("default"))) int graphdist_members(void) {
    return walk_members(NULL, NULL);
}

static void peer_text(const struct ends *e, char *out, size_t size) {
    if (e->v4 || IN6_IS_ADDR_V4MAPPED(&e->peer6))
        inet_ntop(AF_INET, &e->peer6.s6_addr[12], out, (socklen_t)size);
    else
        inet_ntop(AF_INET6, &e->peer6, out, (socklen_t)size);
}

/* ---- the refusal log: bounded, whatever the peers do ------------------------------------ */

#define LOG_INTERVAL_S 10 /* one line per address per interval */
#define LOG_SLOTS 16      /* the addresses remembered */
#define LOG_CAP 20        /* lines per interval, every address together */

static struct {
    struct in6_addr addr;
    time_t when; /* 0: an empty slot */
} log_slots[LOG_SLOTS];
static time_t log_window;         /* when the current interval started */
static unsigned log_lines;        /* lines written in it */
static unsigned long log_unsaid;  /* refusals not written in it */
static char log_busy;             /* a spin lock: accept() runs in many threads */

static time_t log_now(void) {
    struct timespec t;
    if (clock_gettime(CLOCK_MONOTONIC, &t) != 0) return 1;
    return t.tv_sec + 1; /* never 0, which marks an empty slot */
}

/* Whether a refusal of `peer` at `now` gets a line of its own; *unsaid is set to the number of
 * refusals the interval that just ended left unsaid (0: none, or the interval goes on). */
static int log_decide(const struct in6_addr *peer, time_t now, unsigned long *unsaid) {
    int say = 0;
    while (__atomic_test_and_set(&log_busy, __ATOMIC_ACQUIRE)) {}
    *unsaid = 0;
    if (log_window == 0 || now - log_window >= LOG_INTERVAL_S) {
        *unsaid = log_unsaid;
        log_window = now, log_lines = 0, log_unsaid = 0;
    }
    int slot = -1, oldest = 0;
    for (int i = 0; i < LOG_SLOTS; i++) {
        if (log_slots[i].when != 0 && IN6_ARE_ADDR_EQUAL(&log_slots[i].addr, peer)) slot = i;
        if (log_slots[i].when < log_slots[oldest].when) oldest = i;
    }
    if (slot >= 0 && now - log_slots[slot].when < LOG_INTERVAL_S) {
        log_unsaid++; /* said in this interval already */
    } else if (log_lines >= LOG_CAP) {
        log_unsaid++; /* the interval's lines are spent */
    } else {
        slot = slot >= 0 ? slot : oldest;
        log_slots[slot].addr = *peer, log_slots[slot].when = now;
        log_lines++;
        say = 1;
    }
    __atomic_clear(&log_busy, __ATOMIC_RELEASE);
    return say;
}

static void log_line(const char *line, int n, size_t size) {
    if (n <= 0) return;
    ssize_t ignored = write(2, line, (size_t)n < size ? (size_t)n : size - 1);
    (void)ignored;
}

/* Write `text` (a refusal of `addr`, accepted or dialled) if the limiter lets it through, after
 * the line that counts what the interval that just ended left unsaid. */
static void log_refused(const struct in6_addr *addr, const char *text, int n) {
    unsigned long unsaid;
    int say = log_decide(addr, log_now(), &unsaid);
    char line[320];
    if (unsaid > 0)
        log_line(line,
                 snprintf(line, sizeof line,
                          "graphdist: refused %lu more connection(s) in the last %d s, not "
                          "logged one by one (at most one line per address and %d in all per "
                          "%d s)\n",
                          unsaid, LOG_INTERVAL_S, LOG_CAP, LOG_INTERVAL_S),
                 sizeof line);
    if (say) log_line(text, n, 320);
}

/* Log the refusal of a peer from another machine (`listed`: whether a member list was set). */
static void log_refusal(const struct ends *e, int listed) {
    char text[INET6_ADDRSTRLEN], line[320];
    peer_text(e, text, sizeof text);
    int n = listed ? snprintf(line, sizeof line,
                              "graphdist: refused a connection from %s: not a member of this "
                              "cluster (let it in with --allow %s, or allow=[\"%s\"])\n",
                              text, text, text)
                   : snprintf(line, sizeof line,
                              "graphdist: refused a connection from %s: this server was given "
                              "no member list (GRAPHDIST_ALLOW is not set), so it lets in no "
                              "other machine\n",
                              text);
    log_refused(&e->peer6, line, n);
}

/* Whether a peer from another machine may connect: only if GRAPHDIST_ALLOW is set and its
 * address is in the list (no list: no other machine, fail closed). A refusal is logged. */
static int member(const struct ends *e) {
    int hit = 0, count = walk_members(&e->peer6, &hit);
    if (count != -2 && hit) return 1;
    log_refusal(e, count != -2);
    return 0;
}

static void warn_once(int *said, const char *text) {
    if (__atomic_exchange_n(said, 1, __ATOMIC_RELAXED)) return;
    ssize_t ignored = write(2, text, strlen(text));
    (void)ignored;
}

/* Whether the connection on fd may be handed to the caller (see the header). */
static int permitted(int fd) {
    static int said_refused, said_unreadable;
    struct sockaddr_storage me, peer;
    socklen_t me_len = sizeof me, peer_len = sizeof peer;
    int proto = IPPROTO_TCP;
    socklen_t proto_len = sizeof proto;
    if (getsockname(fd, (struct sockaddr *)&me, &me_len) != 0) return 0;
    if (me.ss_family != AF_INET && me.ss_family != AF_INET6) return 1;
    getsockopt(fd, SOL_SOCKET, SO_PROTOCOL, &proto, &proto_len);
    if (proto != IPPROTO_TCP) return 1;
    if (getpeername(fd, (struct sockaddr *)&peer, &peer_len) != 0 || peer.ss_family != me.ss_family)
        return 0; /* reset before we looked: nothing to serve */

    struct ends e;
    if (me.ss_family == AF_INET) {
        const struct sockaddr_in *m = (const void *)&me, *p = (const void *)&peer;
        e.v4 = 1;
        e.me4 = m->sin_addr, e.peer4 = p->sin_addr;
        e.me_port = m->sin_port, e.peer_port = p->sin_port;
        map_v4(&e.me6, &e.me4), map_v4(&e.peer6, &e.peer4);
    } else {
        const struct sockaddr_in6 *m = (const void *)&me, *p = (const void *)&peer;
        e.me6 = m->sin6_addr, e.peer6 = p->sin6_addr;
        e.me_port = m->sin6_port, e.peer_port = p->sin6_port;
        e.v4 = IN6_IS_ADDR_V4MAPPED(&e.peer6) && IN6_IS_ADDR_V4MAPPED(&e.me6);
        memcpy(&e.me4, &e.me6.s6_addr[12], 4), memcpy(&e.peer4, &e.peer6.s6_addr[12], 4);
    }
    /* A peer on this machine, as far as its address tells: loopback, or our own address. */
    int local = e.v4 ? (ntohl(e.peer4.s_addr) >> 24) == 127 || e.peer4.s_addr == e.me4.s_addr
                     : IN6_IS_ADDR_LOOPBACK(&e.peer6) || IN6_ARE_ADDR_EQUAL(&e.peer6, &e.me6);

    unsigned long uid = 0, inode = 0;
    int found = diag_lookup(&e, &uid, &inode);
    if (found == -1 || (found == 0 && local)) found = proc_lookup(&e, &uid, &inode);
    if (found == 1) {
        if (inode != 0 && (uid == 0 || uid == getuid() || uid == geteuid())) return 1;
        warn_once(&said_refused,
                  "graphdist: refused a connection from another user's process (this server "
                  "accepts only its own user and root)\n");
        return 0;
    }
    if (found == -1 && local)
        warn_once(&said_unreadable,
                  "graphdist: cannot tell who connects (no sock_diag, no /proc/net/tcp); "
                  "refusing connections from this machine\n");
    return !local && member(&e); /* no such socket here: another machine's */
}

/* The real accept (use4 == 0) or accept4, repeated while it returns a refused connection.
 * errno is the real call's on failure and left as it set it on success. */
static int accept_checked(int use4, int fd, struct sockaddr *addr, socklen_t *len, int flags) {
    resolve();
    socklen_t room = len != NULL ? *len : 0;
    for (;;) {
        int conn = use4 ? real_accept4(fd, addr, len, flags) : real_accept(fd, addr, len);
        if (conn < 0) return conn;
        int saved = errno;
        if (permitted(conn)) {
            errno = saved;
            return conn;
        }
        close(conn);
        if (len != NULL) *len = room; /* the next peer's address may be longer */
    }
}

int accept(int fd, struct sockaddr *addr, socklen_t *len) {
    return accept_checked(0, fd, addr, len, 0);
}

int accept4(int fd, struct sockaddr *addr, socklen_t *len, int flags) {
    return accept_checked(1, fd, addr, len, flags);
}

/* ---- connect: a server dials only its own cluster ---------------------------------------- */

/* One entry of GRAPHDIST_DIAL: an address (IPv4 v4-mapped) and a port (network byte order). */
struct dial_entry {
    struct in6_addr addr;
    in_port_t port;
};

/* GRAPHDIST_DIAL as last parsed: the text it was parsed from (a copy: the list is parsed again
 * only when the variable changes, as in a forked server that sets it after the library was
 * loaded), its entries, and their count (-1: malformed, every TCP connect refused). */
static struct {
    char *text;
    struct dial_entry *entries;
    int count;
} dial;
static char dial_busy; /* a spin lock: connect() runs in many threads */

/* One entry, "10.0.0.3:2222" or "[fd00::3]:2222" (numeric only: nothing to resolve), of n
 * characters at text: 1 parsed into *out, 0 malformed. */
static int dial_entry_parse(const char *text, size_t n, struct dial_entry *out) {
    char buf[64];
    if (n == 0 || n >= sizeof buf) return 0;
    memcpy(buf, text, n);
    buf[n] = '\0';
    char *host = buf, *colon;
    if (buf[0] == '[') {
        char *close = strchr(buf, ']');
        if (close == NULL || close[1] != ':') return 0;
        *close = '\0';
        host = buf + 1;
        colon = close + 1;
    } else {
        colon = strrchr(buf, ':');
        if (colon == NULL) return 0;
        *colon = '\0';
    }
    const char *digits = colon + 1;
    if (*digits == '\0' || strlen(digits) > 5) return 0;
    long port = 0;
    for (const char *d = digits; *d != '\0'; d++) {
        if (*d < '0' || *d > '9') return 0;
        port = port * 10 + (*d - '0');
    }
    if (port < 1 || port > 65535) return 0;
    struct in_addr v4;
    if (buf[0] != '[' && inet_pton(AF_INET, host, &v4) == 1)
        map_v4(&out->addr, &v4);
    else if (buf[0] != '[' || inet_pton(AF_INET6, host, &out->addr) != 1)
        return 0; /* an IPv6 address must be bracketed: "::1:2222" is ambiguous */
    out->port = htons((uint16_t)port);
    return 1;
}

/* Parse `list` into dial (the lock held): the number of entries, -1 if one is malformed or
 * memory ran out (every TCP connect is then refused: fail closed). Empty entries are skipped,
 * as in GRAPHDIST_ALLOW. */
static int dial_parse(const char *list) {
    if (dial.text != NULL && strcmp(dial.text, list) == 0) return dial.count;
    free(dial.text), free(dial.entries);
    dial.text = strdup(list), dial.entries = NULL, dial.count = -1;
    size_t room = 1;
    for (const char *p = list; *p != '\0'; p++) room += *p == ',';
    dial.entries = malloc(room * sizeof *dial.entries);
    if (dial.text == NULL || dial.entries == NULL) return dial.count;
    int count = 0;
    for (const char *p = list; *p != '\0';) {
        const char *end = strchr(p, ',');
        size_t n = end != NULL ? (size_t)(end - p) : strlen(p);
        if (n > 0 && !dial_entry_parse(p, n, &dial.entries[count++])) return dial.count;
        p += n + (end != NULL);
    }
    return dial.count = count;
}

/* The dial list's entries in this process: their number, -1 if the list is malformed, -2 if
 * GRAPHDIST_DIAL is not set. With `to`, whether (to, port) is on the list (*hit). */
static int dial_lookup(const struct in6_addr *to, in_port_t port, int *hit) {
    const char *list = getenv("GRAPHDIST_DIAL");
    if (list == NULL) return -2;
    while (__atomic_test_and_set(&dial_busy, __ATOMIC_ACQUIRE)) {}
    int count = dial_parse(list);
    for (int i = 0; to != NULL && i < count; i++)
        if (dial.entries[i].port == port && IN6_ARE_ADDR_EQUAL(&dial.entries[i].addr, to))
            *hit = 1;
    __atomic_clear(&dial_busy, __ATOMIC_RELEASE);
    return count;
}

/* For graphdist's own check that the dial list is in force in this process (see members.py):
 * the number of entries in GRAPHDIST_DIAL, -1 if it is malformed, -2 if it is not set. */
__attribute__((visibility("default"))) int graphdist_dial(void) {
    return dial_lookup(NULL, 0, NULL);
}

/* Whether a TCP connect of fd to addr may go ahead (see the header). A refusal is logged. */
static int dialable(int fd, const struct sockaddr *addr, socklen_t len) {
    static int said_malformed;
    struct in6_addr to;
    in_port_t port;
    if (addr == NULL || getenv("GRAPHDIST_DIAL") == NULL) return 1;
    if (addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
        struct sockaddr_in a;
        memcpy(&a, addr, sizeof a);
        map_v4(&to, &a.sin_addr), port = a.sin_port;
    } else if (addr->sa_family == AF_INET6 && len >= sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 a;
        memcpy(&a, addr, sizeof a);
        to = a.sin6_addr, port = a.sin6_port; /* v4-mapped stays so: it equals an IPv4 entry */
    } else {
        return 1; /* AF_UNIX, AF_UNSPEC (a datagram socket's disconnect), ... */
    }
    int type = SOCK_STREAM;
    socklen_t type_len = sizeof type;
    if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &type_len) == 0 && type != SOCK_STREAM)
        return 1; /* UDP: a DNS query, say */
    int hit = 0, count = dial_lookup(&to, port, &hit);
    if (hit || count == -2) return 1; /* -2: unset meanwhile */
    if (count == -1)
        warn_once(&said_malformed,
                  "graphdist: GRAPHDIST_DIAL is malformed (entries are numeric ADDRESS:PORT or "
                  "[IPV6]:PORT, comma-separated), so this server dials no address at all\n");
    char text[INET6_ADDRSTRLEN], line[320];
    if (IN6_IS_ADDR_V4MAPPED(&to))
        inet_ntop(AF_INET, &to.s6_addr[12], text, sizeof text);
    else
        inet_ntop(AF_INET6, &to, text, sizeof text);
    int v6 = !IN6_IS_ADDR_V4MAPPED(&to);
    log_refused(&to, line,
                snprintf(line, sizeof line,
                         "graphdist: refused to dial %s%s%s:%u: not a task of this server's "
                         "cluster (a session's cluster_def may name only the cluster's own "
                         "tasks)\n",
                         v6 ? "[" : "", text, v6 ? "]" : "", (unsigned)ntohs(port)));
    return 0;
}

int connect(int fd, const struct sockaddr *addr, socklen_t len) {
    resolve();
    if (!dialable(fd, addr, len)) {
        errno = ECONNREFUSED;
        return -1;
    }
    return real_connect(fd, addr, len);
}

/* ---- constructor: not inherited by the programs a server starts ------------------------ */

static int same_file(const char *a, const char *b) {
    struct stat sa, sb;
    if (strcmp(a, b) == 0) return 1;
    return stat(a, &sa) == 0 && stat(b, &sb) == 0 && sa.st_dev == sb.st_dev &&
           sa.st_ino == sb.st_ino;
}

__attribute__((constructor)) static void init(void) {
    resolve();
    const char *inherit = getenv("GRAPHDIST_SHIM_INHERIT");
    const char *preload = getenv("LD_PRELOAD");
    Dl_info self;
    if ((inherit != NULL && strcmp(inherit, "1") == 0) || preload == NULL ||
        dladdr((void *)&init, &self) == 0 || self.dli_fname == NULL)
        return;
    char *kept = malloc(strlen(preload) + 1), *copy = strdup(preload);
    if (kept == NULL || copy == NULL) {
        free(kept), free(copy);
        return;
    }
    kept[0] = '\0';
    char *rest = copy, *entry;
    while ((entry = strsep(&rest, ": \t")) != NULL) { /* ld.so splits on ':' and spaces */
        if (entry[0] == '\0' || same_file(entry, self.dli_fname)) continue;
        if (kept[0] != '\0') strcat(kept, ":");
        strcat(kept, entry);
    }
    if (kept[0] == '\0')
        unsetenv("LD_PRELOAD");
    else
        setenv("LD_PRELOAD", kept, 1);
    free(kept), free(copy);
}
