/* rsockets (librdmacm's <rdma/rsocket.h>: rsocket, rbind, rlisten, raccept, rconnect, ...)
 * on ringbell NICs, in one process over the in-process fabric's two NICs (rb0 10.0.0.1,
 * rb1 10.0.0.2): descriptors and their refusals, binding, listening, blocking and
 * non-blocking connects and accepts (a thread accepts where a blocking call needs its
 * peer), the addresses each end reports, data of every size each way through every send
 * and receive call (1 MiB through buffers of 64 KiB: the sender waits for the reader),
 * MSG_PEEK and MSG_DONTWAIT, O_NONBLOCK, rpoll (with an ordinary descriptor among the
 * rsockets) and rselect, refused and unreachable connects, end of stream (rshutdown,
 * rclose), socket and RDMA options, and remote I/O mappings (riomap, riowrite,
 * riounmap). Then datagram sockets (SOCK_DGRAM): kinds and refusals, binding (0.0.0.0 and
 * 127.0.0.1 take rb0), datagrams of 1 to 4088 bytes each way with their sources, 100 in a
 * row in order, EMSGSIZE, truncation, MSG_PEEK, EAGAIN, rpoll, datagrams to a port nobody
 * bound (lost), an implicitly bound sender, and rconnect's filter. Linked with -lrdmacm;
 * the library answers every r* call. A step that hangs fails through alarm(2), naming the
 * step. */
#include "common.h"
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <rdma/rsocket.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/select.h>
#include <sys/socket.h>
#include <sys/uio.h>

/* Ports of the fabric (not the host's): each part of the test has its own. */
#define PORT_BIND 7601	   /* bound and listened on 10.0.0.1 by the binding checks */
#define PORT_MAIN 7610	   /* the main listener, on 0.0.0.0 */
#define PORT_NB 7620	   /* a non-blocking listener, on 10.0.0.1 */
#define PORT_IOMAP 7630	   /* a listener with RDMA_IOMAPSIZE */
#define PORT_OPTS 7640	   /* a listener with 64 KiB buffers and RDMA queue sizes */
#define PORT_NOBODY 7699   /* nobody listens here */
#define BIG (1024 * 1024)

/* ---- a hang fails: alarm(2) names the step it interrupted ---- */

static const char *volatile stage = "start";
#define STAGE(s) (stage = (s))

static void on_alarm(int sig)
{
	static const char pre[] = "rsocket: timed out (SIGALRM) in step: ";
	const char *s = stage;
	ssize_t r = write(2, pre, sizeof pre - 1);
	r = write(2, s, strlen(s));
	r = write(2, "\n", 1);
	(void)r;
	(void)sig;
	_exit(1);
}

/* ---- checks ---- */

/* A call that must return -1 with errno `want`. */
#define CHECK_ERR(expr, want)                                                            \
	do {                                                                             \
		errno = 0;                                                               \
		long long r_ = (long long)(expr);                                        \
		int e_ = errno;                                                          \
		if (r_ != -1 || e_ != (want))                                            \
			FAIL("%s returned %lld, errno %d (%s); want -1 with errno %d (%s)", \
			     #expr, r_, e_, strerror(e_), (int)(want), strerror(want));  \
	} while (0)

static const char *ip_str(const struct sockaddr_in *s, char *buf)
{
	return inet_ntop(AF_INET, &s->sin_addr, buf, INET_ADDRSTRLEN) ? buf : "?";
}

/* `s` is `ip`:`port` (`ip` NULL: any address; `port` -1: any nonzero port). */
#define CHECK_SIN(s, ip, port) check_sin_at(__FILE__, __LINE__, #s, (s), (ip), (port))
static void check_sin_at(const char *file, int line, const char *what,
			 const struct sockaddr_in *s, const char *ip, int port)
{
	char got[INET_ADDRSTRLEN];
	int bad = s->sin_family != AF_INET;
	if (ip) {
		struct sockaddr_in want = sin_of(ip, 0);
		bad |= s->sin_addr.s_addr != want.sin_addr.s_addr;
	}
	bad |= port < 0 ? s->sin_port == 0 : ntohs(s->sin_port) != port;
	if (bad) {
		fprintf(stderr, "%s:%d: %s is family %d, %s:%d; want AF_INET, %s:%d\n", file, line,
			what, s->sin_family, ip_str(s, got), ntohs(s->sin_port), ip ? ip : "*",
			port);
		exit(1);
	}
}

/* rgetsockname or rgetpeername of `fd`, which must succeed with an AF_INET address of
 * sizeof(struct sockaddr_in) bytes. */
#define NAME_OF(get, fd) name_of_at(__FILE__, __LINE__, #get, (get), (fd))
static struct sockaddr_in name_of_at(const char *file, int line, const char *what,
				     int (*get)(int, struct sockaddr *, socklen_t *), int fd)
{
	struct sockaddr_storage ss;
	memset(&ss, 0xa5, sizeof ss);
	socklen_t len = sizeof ss;
	errno = 0;
	int r = get(fd, (struct sockaddr *)&ss, &len);
	if (r != 0 || len != sizeof(struct sockaddr_in) || ss.ss_family != AF_INET) {
		int e = errno;
		fprintf(stderr, "%s:%d: %s(%d) returned %d (errno %d: %s), length %u, family %d\n",
			file, line, what, fd, r, e, strerror(e), (unsigned)len, ss.ss_family);
		exit(1);
	}
	struct sockaddr_in s;
	memcpy(&s, &ss, sizeof s);
	return s;
}

static int same_sin(const struct sockaddr_in *a, const struct sockaddr_in *b)
{
	return a->sin_addr.s_addr == b->sin_addr.s_addr && a->sin_port == b->sin_port;
}

/* A stream rsocket. */
static int rs_new(void)
{
	errno = 0;
	int fd = rsocket(AF_INET, SOCK_STREAM, 0);
	if (fd < 0)
		FAIL("rsocket(AF_INET, SOCK_STREAM, 0) returned %d: errno %d (%s)", fd, errno,
		     strerror(errno));
	return fd;
}

static void set_int(int fd, int level, int name, int v)
{
	CHECK_OK(rsetsockopt(fd, level, name, &v, sizeof v));
}

static int get_int(int fd, int level, int name)
{
	int v = -12345;
	socklen_t len = sizeof v;
	CHECK_OK(rgetsockopt(fd, level, name, &v, &len));
	CHECK_EQ(len, sizeof(int));
	return v;
}

static void set_nonblocking(int fd, int on)
{
	int fl = rfcntl(fd, F_GETFL);
	CHECK(fl >= 0);
	CHECK_OK(rfcntl(fd, F_SETFL, on ? fl | O_NONBLOCK : fl & ~O_NONBLOCK));
	CHECK_EQ(!!(rfcntl(fd, F_GETFL) & O_NONBLOCK), !!on);
}

/* rpoll of one descriptor: its revents, or 0 when rpoll returned 0 (fails otherwise). */
static short poll_one(int fd, short events, int timeout)
{
	struct pollfd p = {.fd = fd, .events = events};
	errno = 0;
	int r = rpoll(&p, 1, timeout);
	if (r < 0 || r > 1)
		FAIL("rpoll({%d, 0x%x}, 1, %d) returned %d: errno %d (%s)", fd, events, timeout, r,
		     errno, strerror(errno));
	if (r == 0 && p.revents != 0)
		FAIL("rpoll returned 0 with revents 0x%x", p.revents);
	if (r == 1 && p.revents == 0)
		FAIL("rpoll returned 1 with revents 0");
	return r ? p.revents : 0;
}

/* ---- data ---- */

/* Sends all `n` bytes (rsend may take fewer; a non-blocking socket waits in rpoll). */
#define SEND_ALL(fd, buf, n) send_all_at(__FILE__, __LINE__, (fd), (buf), (n))
static void send_all_at(const char *file, int line, int fd, const void *buf, size_t n)
{
	const char *p = buf;
	size_t left = n;
	double end = now_s() + 30;
	while (left > 0) {
		errno = 0;
		ssize_t r = rsend(fd, p, left, 0);
		if (r > 0 && (size_t)r <= left) {
			p += r;
			left -= r;
			continue;
		}
		int e = errno;
		if (r < 0 && (e == EAGAIN || e == EWOULDBLOCK) && now_s() < end) {
			poll_one(fd, POLLOUT, 1000);
			continue;
		}
		fprintf(stderr, "%s:%d: rsend(%d, %zu bytes) returned %zd with %zu of %zu left: "
				"errno %d (%s)\n",
			file, line, fd, left, r, left, n, e, strerror(e));
		exit(1);
	}
}

/* Receives exactly `n` bytes (rrecv may return fewer; a non-blocking socket waits in
 * rpoll); the end of the stream before them fails. */
#define RECV_ALL(fd, buf, n) recv_all_at(__FILE__, __LINE__, (fd), (buf), (n))
static void recv_all_at(const char *file, int line, int fd, void *buf, size_t n)
{
	char *p = buf;
	size_t got = 0;
	double end = now_s() + 30;
	while (got < n) {
		errno = 0;
		ssize_t r = rrecv(fd, p + got, n - got, 0);
		if (r > 0 && (size_t)r <= n - got) {
			got += r;
			continue;
		}
		int e = errno;
		if (r < 0 && (e == EAGAIN || e == EWOULDBLOCK) && now_s() < end) {
			poll_one(fd, POLLIN, 1000);
			continue;
		}
		fprintf(stderr, "%s:%d: rrecv(%d) returned %zd after %zu of %zu bytes: errno %d (%s)\n",
			file, line, fd, r, got, n, e, strerror(e));
		exit(1);
	}
}

/* A sender on a thread of its own. */
struct sender {
	pthread_t t;
	int fd;
	const void *buf;
	size_t n;
	atomic_int done;
};

static void *sender_main(void *arg)
{
	struct sender *s = arg;
	SEND_ALL(s->fd, s->buf, s->n);
	atomic_store(&s->done, 1);
	return NULL;
}

static void sender_start(struct sender *s, int fd, const void *buf, size_t n)
{
	s->fd = fd;
	s->buf = buf;
	s->n = n;
	atomic_store(&s->done, 0);
	CHECK_OK(pthread_create(&s->t, NULL, sender_main, s));
}

/* `n` patterned bytes from `tx` to `rx`: a thread sends while this one receives, so a
 * message larger than the buffers passes. */
static void xfer(int tx, int rx, size_t n, unsigned seed)
{
	uint8_t *src = calloc(1, n), *dst = calloc(1, n);
	CHECK(src && dst);
	fill(src, n, seed);
	struct sender s;
	sender_start(&s, tx, src, n);
	RECV_ALL(rx, dst, n);
	CHECK_OK(pthread_join(s.t, NULL));
	if (memcmp(src, dst, n) != 0)
		CHECK_MEM(dst, src, n);
	free(src);
	free(dst);
}

/* Reads `total` bytes into the `cnt` buffers of `iov` with rreadv (`msg` 0) or rrecvmsg
 * (`msg` 1), which may return fewer than asked: each call is given the buffers' rest. */
static void recv_vec(int fd, const struct iovec *iov, int cnt, size_t total, int msg)
{
	size_t got = 0;
	while (got < total) {
		struct iovec rest[8];
		int n = 0;
		size_t skip = got;
		for (int i = 0; i < cnt; i++) {
			if (skip >= iov[i].iov_len) {
				skip -= iov[i].iov_len;
				continue;
			}
			rest[n].iov_base = (char *)iov[i].iov_base + skip;
			rest[n].iov_len = iov[i].iov_len - skip;
			skip = 0;
			n++;
		}
		ssize_t r;
		errno = 0;
		if (msg) {
			struct msghdr m;
			memset(&m, 0, sizeof m);
			m.msg_iov = rest;
			m.msg_iovlen = n;
			r = rrecvmsg(fd, &m, 0);
		} else {
			r = rreadv(fd, rest, n);
		}
		if (r <= 0 || (size_t)r > total - got)
			FAIL("%s returned %zd after %zu of %zu bytes: errno %d (%s)",
			     msg ? "rrecvmsg" : "rreadv", r, got, total, errno, strerror(errno));
		got += r;
	}
}

/* ---- connections ---- */

/* raccept on a thread of its own (a non-blocking listener is polled). */
struct acceptor {
	pthread_t t;
	int lfd, fd;
	struct sockaddr_storage peer;
	socklen_t len;
};

static void *accept_main(void *arg)
{
	struct acceptor *a = arg;
	double end = now_s() + 20;
	for (;;) {
		a->len = sizeof a->peer;
		memset(&a->peer, 0, sizeof a->peer);
		errno = 0;
		a->fd = raccept(a->lfd, (struct sockaddr *)&a->peer, &a->len);
		if (a->fd >= 0)
			return NULL;
		if (errno != EAGAIN && errno != EWOULDBLOCK)
			FAIL("raccept(%d): errno %d (%s)", a->lfd, errno, strerror(errno));
		if (now_s() > end)
			FAIL("raccept(%d): nothing to accept within 20 s", a->lfd);
		poll_one(a->lfd, POLLIN, 1000);
	}
}

static void accept_start(struct acceptor *a, int lfd)
{
	memset(a, 0, sizeof *a);
	a->lfd = lfd;
	a->fd = -1;
	CHECK_OK(pthread_create(&a->t, NULL, accept_main, a));
}

/* The accepted descriptor; the peer's address raccept gave in *peer. */
static int accept_finish(struct acceptor *a, struct sockaddr_in *peer)
{
	CHECK_OK(pthread_join(a->t, NULL));
	CHECK(a->fd >= 0);
	CHECK_EQ(a->len, sizeof(struct sockaddr_in));
	CHECK_EQ(a->peer.ss_family, AF_INET);
	memcpy(peer, &a->peer, sizeof *peer);
	return a->fd;
}

/* Connects `c` (blocking) to the listener `lfd` at `ip`:`port` while a thread accepts:
 * the accepted descriptor, the peer raccept gave in *peer. */
static int connect_to(int lfd, int c, const char *ip, int port, struct sockaddr_in *peer)
{
	struct acceptor a;
	accept_start(&a, lfd);
	struct sockaddr_in d = sin_of(ip, port);
	CHECK_OK(rconnect(c, (struct sockaddr *)&d, sizeof d));
	return accept_finish(&a, peer);
}

/* ---- the parts ---- */

static void descriptors(void)
{
	STAGE("descriptors");
	int p1[2], p2[2];
	CHECK_OK(pipe(p1));
	int a = rs_new(), b = rs_new();
	CHECK_OK(pipe(p2));
	/* Distinct from each other and from every descriptor open before and after. */
	CHECK(a >= 0 && b >= 0 && a != b);
	int others[] = {0, 1, 2, p1[0], p1[1], p2[0], p2[1]};
	for (size_t i = 0; i < sizeof others / sizeof others[0]; i++) {
		CHECK(a != others[i]);
		CHECK(b != others[i]);
	}
	/* rselect takes them in an fd_set. */
	CHECK(a < FD_SETSIZE && b < FD_SETSIZE);
	/* TCP by name, as getaddrinfo's answers give it (rcopy passes them on). */
	int t = rsocket(AF_INET, SOCK_STREAM, IPPROTO_TCP);
	CHECK(t >= 0 && t != a && t != b);
	CHECK_OK(rclose(t));
	CHECK_ERR(rsocket(AF_UNIX, SOCK_STREAM, 0), EAFNOSUPPORT);
	/* Datagram sockets too (see datagrams()). */
	t = rsocket(AF_INET, SOCK_DGRAM, 0);
	CHECK(t >= 0 && t != a && t != b);
	CHECK_OK(rclose(t));
	const int bad = 987654;
	char c = 0;
	struct sockaddr_in addr = sin_of("10.0.0.1", 0);
	CHECK_ERR(rsend(bad, &c, 1, 0), EBADF);
	CHECK_ERR(rrecv(bad, &c, 1, 0), EBADF);
	CHECK_ERR(rbind(bad, (struct sockaddr *)&addr, sizeof addr), EBADF);
	CHECK_ERR(rclose(bad), EBADF);
	CHECK_OK(rclose(a));
	CHECK_OK(rclose(b));
	for (int i = 0; i < 2; i++) {
		CHECK_OK(close(p1[i]));
		CHECK_OK(close(p2[i]));
	}
}

static void binding(void)
{
	STAGE("binding");
	int a = rs_new();
	struct sockaddr_in at = sin_of("10.0.0.1", PORT_BIND);
	CHECK_OK(rbind(a, (struct sockaddr *)&at, sizeof at));
	struct sockaddr_in s = NAME_OF(rgetsockname, a);
	CHECK_SIN(&s, "10.0.0.1", PORT_BIND);
	/* Bound once. */
	struct sockaddr_in other = sin_of("10.0.0.1", PORT_BIND + 1);
	CHECK_ERR(rbind(a, (struct sockaddr *)&other, sizeof other), EINVAL);
	CHECK_OK(rlisten(a, 4));
	/* The port a listener holds. */
	int b = rs_new();
	CHECK_ERR(rbind(b, (struct sockaddr *)&at, sizeof at), EADDRINUSE);
	/* An address no NIC has. */
	struct sockaddr_in off = sin_of("192.168.77.1", PORT_BIND);
	CHECK_ERR(rbind(b, (struct sockaddr *)&off, sizeof off), EADDRNOTAVAIL);
	CHECK_OK(rclose(b));
	/* Port 0: a port is chosen. */
	int c = rs_new();
	struct sockaddr_in any_port = sin_of("10.0.0.2", 0);
	CHECK_OK(rbind(c, (struct sockaddr *)&any_port, sizeof any_port));
	s = NAME_OF(rgetsockname, c);
	CHECK_SIN(&s, "10.0.0.2", -1);
	CHECK_OK(rclose(c));
	CHECK_OK(rclose(a));
}

/* The main listener (returned): 0.0.0.0, PORT_MAIN. Two connections to it: c1 (client)
 * and s1 (accepted) from a client left to choose its NIC, c2 and s2 from a client bound to
 * 10.0.0.2. */
static int connections(int *c1, int *s1, int *c2, int *s2)
{
	STAGE("connections: listen");
	int l = rs_new();
	struct sockaddr_in any = sin_of("0.0.0.0", PORT_MAIN);
	CHECK_OK(rbind(l, (struct sockaddr *)&any, sizeof any));
	CHECK_OK(rlisten(l, 8));
	struct sockaddr_in ln = NAME_OF(rgetsockname, l);
	CHECK_SIN(&ln, NULL, PORT_MAIN);

	STAGE("connections: to 10.0.0.1 from any NIC");
	struct sockaddr_in peer;
	*c1 = rs_new();
	*s1 = connect_to(l, *c1, "10.0.0.1", PORT_MAIN, &peer);
	CHECK(*s1 != l && *s1 != *c1);
	CHECK_SIN(&peer, NULL, -1);
	uint32_t ip = ntohl(peer.sin_addr.s_addr);
	if (ip != 0x0a000001 && ip != 0x0a000002)
		FAIL("the peer raccept gave is 0x%08x, not 10.0.0.1 or 10.0.0.2", ip);
	/* Each end names the other. */
	struct sockaddr_in n = NAME_OF(rgetpeername, *c1);
	CHECK_SIN(&n, "10.0.0.1", PORT_MAIN);
	n = NAME_OF(rgetsockname, *c1);
	CHECK(same_sin(&n, &peer));
	n = NAME_OF(rgetpeername, *s1);
	CHECK(same_sin(&n, &peer));
	n = NAME_OF(rgetsockname, *s1);
	CHECK_SIN(&n, "10.0.0.1", PORT_MAIN);

	STAGE("connections: from 10.0.0.2");
	*c2 = rs_new();
	struct sockaddr_in from = sin_of("10.0.0.2", 0);
	CHECK_OK(rbind(*c2, (struct sockaddr *)&from, sizeof from));
	struct sockaddr_in mine = NAME_OF(rgetsockname, *c2);
	CHECK_SIN(&mine, "10.0.0.2", -1);
	*s2 = connect_to(l, *c2, "10.0.0.1", PORT_MAIN, &peer);
	CHECK_SIN(&peer, "10.0.0.2", ntohs(mine.sin_port));
	n = NAME_OF(rgetpeername, *s2);
	CHECK_SIN(&n, "10.0.0.2", ntohs(mine.sin_port));
	n = NAME_OF(rgetpeername, *c2);
	CHECK_SIN(&n, "10.0.0.1", PORT_MAIN);
	n = NAME_OF(rgetsockname, *c2);
	CHECK_SIN(&n, "10.0.0.2", ntohs(mine.sin_port));
	printf("rsocket: connections ok\n");
	return l;
}

/* Data between the client `c` and the server `s` of a connection: every size each way
 * through rsend and rrecv, then each of the other send and receive calls. */
static void data(int c, int s)
{
	static const size_t sizes[] = {1, 100, 4096, 65536, BIG};
	for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
		STAGE("data: rsend/rrecv, client to server");
		xfer(c, s, sizes[i], 2 * i + 1);
		STAGE("data: rsend/rrecv, server to client");
		xfer(s, c, sizes[i], 2 * i + 2);
	}

	STAGE("data: rwrite/rread");
	char out[300], in[300];
	fill(out, sizeof out, 41);
	memset(in, 0, sizeof in);
	CHECK_EQ(rwrite(c, out, sizeof out), sizeof out);
	for (size_t got = 0; got < sizeof in;) {
		errno = 0;
		ssize_t r = rread(s, in + got, sizeof in - got);
		if (r <= 0)
			FAIL("rread returned %zd after %zu bytes: errno %d (%s)", r, got, errno,
			     strerror(errno));
		got += r;
	}
	CHECK_MEM(in, out, sizeof out);

	STAGE("data: rwritev/rreadv");
	char w0[5], w1[150], w2[300], r0[200], r1[200], r2[55];
	fill(w0, sizeof w0, 51);
	fill(w1, sizeof w1, 52);
	fill(w2, sizeof w2, 53);
	struct iovec wv[3] = {{w0, sizeof w0}, {w1, sizeof w1}, {w2, sizeof w2}};
	struct iovec rv[3] = {{r0, sizeof r0}, {r1, sizeof r1}, {r2, sizeof r2}};
	CHECK_EQ(rwritev(s, wv, 3), 455);
	recv_vec(c, rv, 3, 455, 0);
	char flat[455];
	memcpy(flat, w0, 5);
	memcpy(flat + 5, w1, 150);
	memcpy(flat + 155, w2, 300);
	CHECK_MEM(r0, flat, 200);
	CHECK_MEM(r1, flat + 200, 200);
	CHECK_MEM(r2, flat + 400, 55);

	STAGE("data: rsendmsg/rrecvmsg");
	char m0[40], m1[60], g0[50], g1[50];
	fill(m0, sizeof m0, 61);
	fill(m1, sizeof m1, 62);
	struct iovec mv[2] = {{m0, sizeof m0}, {m1, sizeof m1}};
	struct iovec gv[2] = {{g0, sizeof g0}, {g1, sizeof g1}};
	struct msghdr msg;
	memset(&msg, 0, sizeof msg);
	msg.msg_iov = mv;
	msg.msg_iovlen = 2;
	CHECK_EQ(rsendmsg(c, &msg, 0), 100);
	recv_vec(s, gv, 2, 100, 1);
	CHECK_MEM(g0, m0, 40);
	CHECK_MEM(g0 + 40, m1, 10);
	CHECK_MEM(g1, m1 + 10, 50);

	STAGE("data: rsendto/rrecvfrom without addresses");
	CHECK_EQ(rsendto(s, "sendto", 6, 0, NULL, 0), 6);
	char st[6];
	for (size_t got = 0; got < sizeof st;) {
		errno = 0;
		ssize_t r = rrecvfrom(c, st + got, sizeof st - got, 0, NULL, NULL);
		if (r <= 0)
			FAIL("rrecvfrom returned %zd: errno %d (%s)", r, errno, strerror(errno));
		got += r;
	}
	CHECK_MEM(st, "sendto", 6);
	printf("rsocket: data ok\n");
}

static void peek(int c, int s)
{
	STAGE("MSG_PEEK");
	SEND_ALL(c, "peekaboo", 8);
	CHECK(poll_one(s, POLLIN, 2000) & POLLIN);
	char a[8], b[8];
	memset(a, 0, sizeof a);
	errno = 0;
	ssize_t k = rrecv(s, a, sizeof a, MSG_PEEK);
	if (k < 1 || k > 8)
		FAIL("rrecv(MSG_PEEK) returned %zd: errno %d (%s)", k, errno, strerror(errno));
	CHECK_MEM(a, "peekaboo", k);
	/* Peeked again: the same bytes. */
	memset(b, 0, sizeof b);
	CHECK_EQ(rrecv(s, b, k, MSG_PEEK), k);
	CHECK_MEM(b, "peekaboo", k);
	/* Not consumed: the next rrecv returns them. */
	memset(b, 0, sizeof b);
	CHECK_EQ(rrecv(s, b, k, 0), k);
	CHECK_MEM(b, "peekaboo", k);
	RECV_ALL(s, b + k, 8 - k);
	CHECK_MEM(b, "peekaboo", 8);
}

/* Signal handlers installed with SA_RESTART, running while a call blocks: rpoll fails with
 * EINTR all the same, as poll(2) does; a blocking rrecv goes on, as recv(2) does, and
 * returns the bytes sent after the handler ran. */
static volatile sig_atomic_t usr1_runs;
static void on_usr1(int sig)
{
	(void)sig;
	usr1_runs++;
}

struct later {
	pthread_t target;
	int tx; /* -1: no bytes after the signal */
};

static void *signal_then_send(void *arg)
{
	struct later *l = arg;
	struct timespec ts = {.tv_nsec = 50 * 1000 * 1000};
	nanosleep(&ts, NULL);
	pthread_kill(l->target, SIGUSR1);
	if (l->tx >= 0) {
		nanosleep(&ts, NULL);
		SEND_ALL(l->tx, "late", 4);
	}
	return NULL;
}

static void interrupted(int c, int s)
{
	STAGE("signals while blocked");
	struct sigaction sa = {.sa_handler = on_usr1, .sa_flags = SA_RESTART};
	sigemptyset(&sa.sa_mask);
	CHECK_EQ(sigaction(SIGUSR1, &sa, NULL), 0);
	struct later l = {.target = pthread_self(), .tx = -1};
	pthread_t t;
	CHECK_EQ(pthread_create(&t, NULL, signal_then_send, &l), 0);
	struct pollfd p = {.fd = s, .events = POLLIN};
	CHECK_ERR(rpoll(&p, 1, -1), EINTR);
	CHECK_EQ(pthread_join(t, NULL), 0);
	CHECK_EQ(usr1_runs, 1);
	l.tx = c;
	CHECK_EQ(pthread_create(&t, NULL, signal_then_send, &l), 0);
	char buf[4];
	CHECK_EQ(rrecv(s, buf, sizeof buf, MSG_WAITALL), 4);
	CHECK_MEM(buf, "late", 4);
	CHECK_EQ(usr1_runs, 2);
	CHECK_EQ(pthread_join(t, NULL), 0);
	signal(SIGUSR1, SIG_DFL);
}

/* O_NONBLOCK, MSG_DONTWAIT and rpoll on a connected pair with nothing in flight; then a
 * non-blocking listener (returned) with nothing to accept. */
static int nonblocking_and_polling(int c, int s)
{
	STAGE("non-blocking receives");
	char buf[16];
	CHECK_ERR(rrecv(s, buf, sizeof buf, MSG_DONTWAIT), EAGAIN);
	int fl = rfcntl(s, F_GETFL);
	CHECK(fl >= 0);
	CHECK_EQ(fl & O_NONBLOCK, 0);
	CHECK_OK(rfcntl(s, F_SETFL, fl | O_NONBLOCK));
	CHECK(rfcntl(s, F_GETFL) & O_NONBLOCK);
	CHECK_ERR(rrecv(s, buf, sizeof buf, 0), EAGAIN);

	STAGE("rpoll");
	CHECK_EQ(poll_one(s, POLLIN, 0), 0);
	CHECK(poll_one(c, POLLOUT, 2000) & POLLOUT);
	SEND_ALL(c, "hello", 5);
	CHECK(poll_one(s, POLLIN, 2000) & POLLIN);
	RECV_ALL(s, buf, 5);
	CHECK_MEM(buf, "hello", 5);
	CHECK_ERR(rrecv(s, buf, sizeof buf, 0), EAGAIN);

	STAGE("rpoll with an ordinary descriptor");
	int pp[2];
	CHECK_OK(pipe(pp));
	CHECK_EQ(write(pp[1], "p", 1), 1);
	struct pollfd f[2] = {{.fd = s, .events = POLLIN}, {.fd = pp[0], .events = POLLIN}};
	CHECK_EQ(rpoll(f, 2, 2000), 1);
	CHECK_EQ(f[0].revents, 0);
	CHECK(f[1].revents & POLLIN);
	CHECK_EQ(read(pp[0], buf, 1), 1);
	/* The pipe empty, the rsocket readable. */
	SEND_ALL(c, "q", 1);
	f[0].revents = f[1].revents = 0;
	CHECK_EQ(rpoll(f, 2, 2000), 1);
	CHECK(f[0].revents & POLLIN);
	CHECK_EQ(f[1].revents, 0);
	RECV_ALL(s, buf, 1);
	CHECK_EQ(buf[0], 'q');
	CHECK_OK(close(pp[0]));
	CHECK_OK(close(pp[1]));

	STAGE("rselect");
	CHECK(s < FD_SETSIZE);
	SEND_ALL(c, "sel", 3);
	fd_set rd;
	FD_ZERO(&rd);
	FD_SET(s, &rd);
	struct timeval tv = {.tv_sec = 2};
	CHECK_EQ(rselect(s + 1, &rd, NULL, NULL, &tv), 1);
	CHECK(FD_ISSET(s, &rd));
	RECV_ALL(s, buf, 3);
	CHECK_MEM(buf, "sel", 3);
	/* Nothing left: 0, the bit cleared. */
	FD_ZERO(&rd);
	FD_SET(s, &rd);
	tv.tv_sec = 0;
	tv.tv_usec = 0;
	CHECK_EQ(rselect(s + 1, &rd, NULL, NULL, &tv), 0);
	CHECK(!FD_ISSET(s, &rd));
	set_nonblocking(s, 0);

	STAGE("a non-blocking listener");
	int l = rs_new();
	struct sockaddr_in at = sin_of("10.0.0.1", PORT_NB);
	CHECK_OK(rbind(l, (struct sockaddr *)&at, sizeof at));
	CHECK_OK(rlisten(l, 4));
	set_nonblocking(l, 1);
	struct sockaddr_in peer;
	socklen_t len = sizeof peer;
	CHECK_ERR(raccept(l, (struct sockaddr *)&peer, &len), EAGAIN);
	CHECK_EQ(poll_one(l, POLLIN, 0), 0);
	printf("rsocket: non-blocking calls and polling ok\n");
	return l;
}

/* A non-blocking connect to the non-blocking listener `l`. */
static void nonblocking_connect(int l)
{
	STAGE("non-blocking connect");
	int c = rs_new();
	set_nonblocking(c, 1);
	struct sockaddr_in to = sin_of("10.0.0.1", PORT_NB);
	CHECK_ERR(rconnect(c, (struct sockaddr *)&to, sizeof to), EINPROGRESS);

	STAGE("non-blocking connect: the listener shows POLLIN");
	/* The connecting socket is polled too (it may progress only when polled). */
	double end = now_s() + 10;
	for (;;) {
		struct pollfd f[2] = {{.fd = l, .events = POLLIN}, {.fd = c, .events = POLLOUT}};
		errno = 0;
		int r = rpoll(f, 2, 1000);
		CHECK(r >= 0 && r <= 2);
		CHECK_EQ(f[0].revents & ~POLLIN, 0);
		if (f[0].revents & POLLIN)
			break;
		if (now_s() > end)
			FAIL("the listener shows no POLLIN within 10 s (client revents 0x%x)",
			     f[1].revents);
	}

	STAGE("non-blocking connect: accept, POLLOUT");
	struct acceptor a;
	accept_start(&a, l);
	short ev = poll_one(c, POLLOUT, 5000);
	CHECK(ev & POLLOUT);
	CHECK_EQ(ev & (POLLERR | POLLHUP), 0);
	CHECK_EQ(get_int(c, SOL_SOCKET, SO_ERROR), 0);
	struct sockaddr_in peer;
	int s = accept_finish(&a, &peer);
	CHECK_SIN(&peer, NULL, -1);
	struct sockaddr_in n = NAME_OF(rgetpeername, c);
	CHECK_SIN(&n, "10.0.0.1", PORT_NB);

	STAGE("non-blocking connect: data");
	char buf[16];
	SEND_ALL(c, "nonblocking", 11);
	RECV_ALL(s, buf, 11);
	CHECK_MEM(buf, "nonblocking", 11);
	SEND_ALL(s, "reply", 5);
	RECV_ALL(c, buf, 5);
	CHECK_MEM(buf, "reply", 5);
	CHECK_OK(rclose(c));
	CHECK_OK(rclose(s));
	printf("rsocket: non-blocking connect ok\n");
}

static void refusals(void)
{
	STAGE("a connect nobody answers");
	int c = rs_new();
	struct sockaddr_in to = sin_of("10.0.0.2", PORT_NOBODY);
	CHECK_ERR(rconnect(c, (struct sockaddr *)&to, sizeof to), ECONNREFUSED);
	CHECK_OK(rclose(c));

	STAGE("a connect to an address off the fabric's NICs");
	c = rs_new();
	to = sin_of("10.0.0.77", PORT_MAIN);
	double t0 = now_s();
	errno = 0;
	int r = rconnect(c, (struct sockaddr *)&to, sizeof to);
	int e = errno;
	if (r != -1 || (e != EHOSTUNREACH && e != ENETUNREACH && e != ETIMEDOUT))
		FAIL("rconnect to 10.0.0.77 returned %d, errno %d (%s); want -1 with EHOSTUNREACH, "
		     "ENETUNREACH or ETIMEDOUT",
		     r, e, strerror(e));
	printf("rsocket: rconnect to 10.0.0.77: %s after %.2f s\n", strerror(e), now_s() - t0);
	CHECK_OK(rclose(c));

	STAGE("an unconnected socket");
	int u = rs_new();
	char x = 'x';
	CHECK_ERR(rsend(u, &x, 1, 0), ENOTCONN);
	CHECK_ERR(rrecv(u, &x, 1, 0), ENOTCONN);
	struct sockaddr_in p;
	socklen_t len = sizeof p;
	CHECK_ERR(rgetpeername(u, (struct sockaddr *)&p, &len), ENOTCONN);
	CHECK_OK(rclose(u));
}

/* End of stream: rshutdown(SHUT_WR) on one end, then rclose of the other. */
static void end_of_stream(int l)
{
	STAGE("shutdown: connect");
	int c = rs_new();
	struct sockaddr_in peer;
	int s = connect_to(l, c, "10.0.0.1", PORT_MAIN, &peer);

	STAGE("shutdown: SHUT_WR");
	char buf[32];
	SEND_ALL(c, "before shutdown", 15);
	CHECK_OK(rshutdown(c, SHUT_WR));
	RECV_ALL(s, buf, 15);
	CHECK_MEM(buf, "before shutdown", 15);
	/* The end of the stream is readable, and reads 0, every time. */
	CHECK(poll_one(s, POLLIN, 5000) & POLLIN);
	CHECK_EQ(rrecv(s, buf, sizeof buf, 0), 0);
	CHECK_EQ(rrecv(s, buf, sizeof buf, 0), 0);
	/* The other direction still flows. */
	SEND_ALL(s, "after", 5);
	RECV_ALL(c, buf, 5);
	CHECK_MEM(buf, "after", 5);
	/* Nothing more from the end that shut down. */
	CHECK_ERR(rsend(c, "x", 1, 0), EPIPE);

	STAGE("shutdown: the peer closes");
	SEND_ALL(s, "last words", 10);
	CHECK_OK(rclose(s));
	CHECK(poll_one(c, POLLIN, 5000) & POLLIN);
	RECV_ALL(c, buf, 10);
	CHECK_MEM(buf, "last words", 10);
	CHECK_EQ(rrecv(c, buf, sizeof buf, 0), 0);
	short ev = poll_one(c, POLLIN, 2000);
	CHECK(ev & POLLIN);
	CHECK_EQ(rrecv(c, buf, sizeof buf, 0), 0);
	CHECK_OK(rclose(c));
	printf("rsocket: end of stream ok (revents after the peer closed: 0x%x)\n", ev);
}

/* Options on a socket before it binds and connects (from rb1), and on a listener (its
 * accepted sockets inherit them); then 1 MiB through the 64 KiB buffers: the sender waits
 * for the reader. */
static void options(void)
{
	STAGE("options");
	int o = rs_new();
	const int flags[][2] = {{SOL_SOCKET, SO_REUSEADDR},
				{SOL_SOCKET, SO_KEEPALIVE},
				{IPPROTO_TCP, TCP_NODELAY}};
	for (size_t i = 0; i < 3; i++) {
		set_int(o, flags[i][0], flags[i][1], 1);
		CHECK(get_int(o, flags[i][0], flags[i][1]) != 0);
	}
	set_int(o, SOL_SOCKET, SO_SNDBUF, 65536);
	set_int(o, SOL_SOCKET, SO_RCVBUF, 65536);
	CHECK(get_int(o, SOL_SOCKET, SO_SNDBUF) > 0);
	CHECK(get_int(o, SOL_SOCKET, SO_RCVBUF) > 0);
	set_int(o, SOL_RDMA, RDMA_SQSIZE, 64);
	set_int(o, SOL_RDMA, RDMA_RQSIZE, 64);
	set_int(o, SOL_RDMA, RDMA_INLINE, 64);
	int one = 1;
	CHECK_ERR(rsetsockopt(o, SOL_SOCKET, 9999, &one, sizeof one), ENOPROTOOPT);
	socklen_t len = sizeof one;
	CHECK_ERR(rgetsockopt(o, SOL_SOCKET, 9999, &one, &len), ENOPROTOOPT);
	CHECK_ERR(rsetsockopt(o, SOL_SOCKET, SO_KEEPALIVE, &one, 1), EINVAL);
	CHECK_ERR(rsetsockopt(o, IPPROTO_TCP, TCP_NODELAY, &one, 1), EINVAL);

	STAGE("options: a listener's");
	int l = rs_new();
	set_int(l, SOL_SOCKET, SO_REUSEADDR, 1);
	set_int(l, SOL_SOCKET, SO_SNDBUF, 65536);
	set_int(l, SOL_SOCKET, SO_RCVBUF, 65536);
	set_int(l, SOL_RDMA, RDMA_SQSIZE, 32);
	set_int(l, SOL_RDMA, RDMA_RQSIZE, 32);
	set_int(l, SOL_RDMA, RDMA_INLINE, 32);
	struct sockaddr_in at = sin_of("0.0.0.0", PORT_OPTS);
	CHECK_OK(rbind(l, (struct sockaddr *)&at, sizeof at));
	CHECK_OK(rlisten(l, 2));

	STAGE("options: connect");
	struct sockaddr_in from = sin_of("10.0.0.2", 0), peer;
	CHECK_OK(rbind(o, (struct sockaddr *)&from, sizeof from));
	int s = connect_to(l, o, "10.0.0.1", PORT_OPTS, &peer);
	CHECK_SIN(&peer, "10.0.0.2", -1);
	CHECK(get_int(o, IPPROTO_TCP, TCP_NODELAY) != 0);

	STAGE("options: 1 MiB through 64 KiB buffers");
	uint8_t *src = malloc(BIG), *dst = calloc(1, BIG);
	CHECK(src && dst);
	fill(src, BIG, 77);
	struct sender tx;
	sender_start(&tx, o, src, BIG);
	usleep(300 * 1000);
	if (atomic_load(&tx.done))
		FAIL("1 MiB was sent through 64 KiB buffers before the peer read any of it");
	RECV_ALL(s, dst, BIG);
	CHECK_OK(pthread_join(tx.t, NULL));
	CHECK_MEM(dst, src, BIG);
	free(src);
	free(dst);
	STAGE("options: and back");
	xfer(s, o, BIG, 78);
	xfer(o, s, 65536, 79);
	CHECK_OK(rclose(o));
	CHECK_OK(rclose(s));
	CHECK_OK(rclose(l));
	printf("rsocket: options ok\n");
}

/* riomap on the accepting side, riowrite from the connecting side. */
static void iomap(void)
{
	STAGE("iomap: listen and connect");
	int l = rs_new();
	set_int(l, SOL_RDMA, RDMA_IOMAPSIZE, 1);
	struct sockaddr_in at = sin_of("0.0.0.0", PORT_IOMAP);
	CHECK_OK(rbind(l, (struct sockaddr *)&at, sizeof at));
	CHECK_OK(rlisten(l, 2));
	int c = rs_new();
	set_int(c, SOL_RDMA, RDMA_IOMAPSIZE, 1);
	struct sockaddr_in peer;
	int s = connect_to(l, c, "10.0.0.1", PORT_IOMAP, &peer);

	STAGE("iomap: riomap, riowrite");
	uint8_t *buf = aligned_alloc(4096, 4096), *data = malloc(4096);
	CHECK(buf && data);
	memset(buf, 0, 4096);
	fill(data, 4096, 91);
	errno = 0;
	off_t off = riomap(s, buf, 4096, PROT_WRITE, 0, 0);
	if (off != 0)
		FAIL("riomap returned %lld: errno %d (%s)", (long long)off, errno, strerror(errno));
	SEND_ALL(s, "m", 1);
	char b;
	RECV_ALL(c, &b, 1);
	CHECK_EQ(b, 'm');
	errno = 0;
	size_t w = riowrite(c, data, 4096, 0, 0);
	if (w != 4096)
		FAIL("riowrite returned %zd: errno %d (%s)", (ssize_t)w, errno, strerror(errno));
	SEND_ALL(c, "d", 1);
	RECV_ALL(s, &b, 1);
	CHECK_EQ(b, 'd');
	CHECK_MEM(buf, data, 4096);

	STAGE("iomap: an offset no mapping covers");
	errno = 0;
	w = riowrite(c, data, 16, 1 << 20, 0);
	int e = errno;
	if ((ssize_t)w != -1 || (e != EINVAL && e != EACCES))
		FAIL("riowrite to an unmapped offset returned %zd, errno %d (%s); want -1 with "
		     "EINVAL or EACCES",
		     (ssize_t)w, e, strerror(e));
	CHECK_OK(riounmap(s, buf, 4096));
	CHECK_OK(rclose(c));
	CHECK_OK(rclose(s));
	CHECK_OK(rclose(l));
	free(buf);
	free(data);
	printf("rsocket: iomap ok\n");
}

/* ---- datagrams (SOCK_DGRAM) ---- */

/* Ports of the fabric's datagram sockets. */
#define PORT_DG_A 7701	    /* a, on 10.0.0.1 */
#define PORT_DG_B 7702	    /* b, on 10.0.0.2 */
#define PORT_DG_LO 7703	    /* bound to 127.0.0.1: the first NIC's */
#define PORT_DG_NOBODY 7799 /* no datagram socket binds it */
#define PORT_DG_UNREACH 7798
#define DG_MAX 4088	    /* the largest datagram */
#define DG_ROW 100	    /* datagrams sent in a row before any is read */

/* Checks that do not stop the program: a failure is printed and counted, the rest runs,
 * and the program exits 1 at the end. */
static int soft_failures;

/* A call that must return -1 with errno `want`; a failure is counted (soft_failures) and
 * the program goes on (nothing after depends on it). */
#define SOFT_ERR(expr, want)                                                             \
	do {                                                                             \
		errno = 0;                                                               \
		long long r_ = (long long)(expr);                                        \
		int e_ = errno;                                                          \
		if (r_ != -1 || e_ != (want)) {                                          \
			fprintf(stderr,                                                  \
				"%s:%d: rsocket: FAILED: %s returned %lld, errno %d (%s); "  \
				"want -1 with errno %d (%s)\n",                              \
				__FILE__, __LINE__, #expr, r_, e_, strerror(e_), (int)(want), \
				strerror(want));                                         \
			soft_failures++;                                                 \
		}                                                                        \
	} while (0)

/* A datagram rsocket. */
static int dg_new(void)
{
	errno = 0;
	int fd = rsocket(AF_INET, SOCK_DGRAM, 0);
	if (fd < 0)
		FAIL("rsocket(AF_INET, SOCK_DGRAM, 0) returned %d: errno %d (%s)", fd, errno,
		     strerror(errno));
	return fd;
}

static void dg_bind(int fd, const char *ip, int port)
{
	struct sockaddr_in at = sin_of(ip, port);
	CHECK_OK(rbind(fd, (struct sockaddr *)&at, sizeof at));
}

/* One datagram of `n` bytes to `ip`:`port`: rsendto must return `n`. */
#define DG_SEND(fd, buf, n, ip, port) dg_send_at(__FILE__, __LINE__, (fd), (buf), (n), (ip), (port))
static void dg_send_at(const char *file, int line, int fd, const void *buf, size_t n,
		       const char *ip, int port)
{
	struct sockaddr_in to = sin_of(ip, port);
	errno = 0;
	ssize_t r = rsendto(fd, buf, n, 0, (struct sockaddr *)&to, sizeof to);
	if (r != (ssize_t)n) {
		int e = errno;
		fprintf(stderr, "%s:%d: rsendto(%d, %zu bytes, %s:%d) returned %zd: errno %d (%s)\n",
			file, line, fd, n, ip, port, r, e, strerror(e));
		exit(1);
	}
}

/* One datagram received by rrecvfrom(`fd`, `buf`, `cap`, `flags`): it must return `n`,
 * with the source `ip`:`port` (`port` -1: any nonzero port). */
#define DG_RECV(fd, buf, cap, flags, n, ip, port)                                        \
	dg_recv_at(__FILE__, __LINE__, (fd), (buf), (cap), (flags), (n), (ip), (port))
static void dg_recv_at(const char *file, int line, int fd, void *buf, size_t cap, int flags,
		       size_t n, const char *ip, int port)
{
	struct sockaddr_storage ss;
	memset(&ss, 0xa5, sizeof ss);
	socklen_t len = sizeof ss;
	errno = 0;
	ssize_t r = rrecvfrom(fd, buf, cap, flags, (struct sockaddr *)&ss, &len);
	if (r != (ssize_t)n || len != sizeof(struct sockaddr_in)) {
		int e = errno;
		fprintf(stderr, "%s:%d: rrecvfrom(%d, %zu bytes, flags 0x%x) returned %zd (errno %d: "
				"%s) with an address of %u bytes; want %zu bytes and %zu\n",
			file, line, fd, cap, flags, r, e, strerror(e), (unsigned)len, n,
			sizeof(struct sockaddr_in));
		exit(1);
	}
	struct sockaddr_in s;
	memcpy(&s, &ss, sizeof s);
	check_sin_at(file, line, "the source rrecvfrom gave", &s, ip, port);
}

/* The port of datagram socket `fd` (rgetsockname). */
static int dg_port(int fd)
{
	struct sockaddr_in s = NAME_OF(rgetsockname, fd);
	return ntohs(s.sin_port);
}

/* Waits (up to WAIT_S) until a datagram is queued at `rx`, polling `tx` too (with no
 * events: rpoll drives it), so that a datagram `tx` sent before its destination was
 * resolved goes whether or not the library sends it on its own. */
static void await_dgram(int rx, int tx)
{
	double end = now_s() + WAIT_S;
	for (;;) {
		struct pollfd f[2] = {{.fd = rx, .events = POLLIN}, {.fd = tx, .events = 0}};
		errno = 0;
		int r = rpoll(f, 2, 100);
		if (r < 0)
			FAIL("rpoll: errno %d (%s)", errno, strerror(errno));
		CHECK_EQ(f[1].revents & ~POLLOUT, 0);
		if (f[0].revents & POLLIN)
			return;
		CHECK_EQ(f[0].revents, 0);
		if (now_s() > end)
			FAIL("no datagram at %d within %.0f s", rx, WAIT_S);
	}
}

/* The first datagram `tx` sends to `rx`'s address: rsendto returned its length at once,
 * and the library sends it once the destination's QP is known, with nothing more asked of
 * the sender, so it arrives while only `rx` is polled. If it does not (within WAIT_S), the
 * failure is counted and `tx` is polled too, so that the rest goes on. */
static void await_first(int rx, int tx, const char *what)
{
	STAGE("datagrams: the first datagram to a new destination");
	if (poll_one(rx, POLLIN, (int)(WAIT_S * 1000)) & POLLIN)
		return;
	fprintf(stderr, "rsocket: FAILED: %s: the first datagram to a new destination has not "
			"arrived %.0f s after rsendto returned, while only the receiver was "
			"polled\n",
		what, WAIT_S);
	soft_failures++;
	double t0 = now_s();
	await_dgram(rx, tx);
	fprintf(stderr, "rsocket: (%s: it arrived %.3f s after the sender was polled too)\n", what,
		now_s() - t0);
}

/* Kinds and protocols, options, and the calls a datagram socket refuses. */
/* A datagram `msg` (a string literal) from tx to rx at (dip, dport): rx waits for it and
 * gets it whole, from (sip, sport). */
#define DG_HOP(tx, rx, msg, dip, dport, sip, sport)                                      \
	do {                                                                             \
		char hop_[64];                                                           \
		DG_SEND((tx), (msg), sizeof(msg) - 1, (dip), (dport));                   \
		await_dgram((rx), (tx));                                                 \
		DG_RECV((rx), hop_, sizeof hop_, 0, sizeof(msg) - 1, (sip), (sport));    \
		CHECK_MEM(hop_, (msg), sizeof(msg) - 1);                                 \
	} while (0)

static void dgram_sockets(void)
{
	STAGE("datagrams: sockets");
	int d = dg_new();
	errno = 0;
	int u = rsocket(AF_INET, SOCK_DGRAM, IPPROTO_UDP);
	if (u < 0)
		FAIL("rsocket(AF_INET, SOCK_DGRAM, IPPROTO_UDP): errno %d (%s)", errno,
		     strerror(errno));
	CHECK(u != d);
	SOFT_ERR(rsocket(AF_INET, SOCK_DGRAM, IPPROTO_TCP), EPROTONOSUPPORT);
	SOFT_ERR(rsocket(AF_INET, SOCK_RAW, 0), ESOCKTNOSUPPORT);
	CHECK_EQ(get_int(d, SOL_SOCKET, SO_TYPE), SOCK_DGRAM);
	CHECK_EQ(get_int(u, SOL_SOCKET, SO_TYPE), SOCK_DGRAM);
	int s = rs_new();
	CHECK_EQ(get_int(s, SOL_SOCKET, SO_TYPE), SOCK_STREAM);
	CHECK_OK(rclose(s));

	STAGE("datagrams: refusals");
	SOFT_ERR(rlisten(d, 4), EOPNOTSUPP);
	struct sockaddr_in peer;
	socklen_t len = sizeof peer;
	SOFT_ERR(raccept(d, (struct sockaddr *)&peer, &len), EOPNOTSUPP);
	len = sizeof peer;
	SOFT_ERR(rgetpeername(d, (struct sockaddr *)&peer, &len), ENOTCONN);
	/* No destination: neither given nor connected. */
	SOFT_ERR(rsend(d, "x", 1, 0), EDESTADDRREQ);
	/* One byte too many. */
	static char big[DG_MAX + 1];
	struct sockaddr_in to = sin_of("10.0.0.2", PORT_DG_B);
	SOFT_ERR(rsendto(d, big, DG_MAX + 1, 0, (struct sockaddr *)&to, sizeof to), EMSGSIZE);
	/* An address of the fabric's plan that no NIC has: lost, as a UDP datagram to a
	 * host that does not answer is (the send returns once its resolution has failed). */
	struct sockaddr_in none = sin_of("10.0.0.77", PORT_DG_UNREACH);
	CHECK(rsendto(u, "x", 1, 0, (struct sockaddr *)&none, sizeof none) == 1);
	/* An address outside the fabric: no route. */
	struct sockaddr_in off = sin_of("192.168.77.1", PORT_DG_UNREACH);
	SOFT_ERR(rsendto(u, "x", 1, 0, (struct sockaddr *)&off, sizeof off), EHOSTUNREACH);
	CHECK_OK(rclose(d));
	CHECK_OK(rclose(u));
}

/* a on 10.0.0.1 and b on 10.0.0.2 (returned), with the addresses they report; a port
 * another socket holds; the unspecified and loopback addresses (*any and *lo: the first
 * NIC's). */
static void dgram_binding(int *a, int *b, int *any, int *lo)
{
	STAGE("datagrams: binding");
	*a = dg_new();
	dg_bind(*a, "10.0.0.1", PORT_DG_A);
	struct sockaddr_in n = NAME_OF(rgetsockname, *a);
	CHECK_SIN(&n, "10.0.0.1", PORT_DG_A);
	*b = dg_new();
	/* Room for DG_ROW datagrams sent before any is read (a full receive queue drops what
	 * comes, as UDP's does). */
	set_int(*b, SOL_SOCKET, SO_RCVBUF, 4 << 20);
	dg_bind(*b, "10.0.0.2", PORT_DG_B);
	n = NAME_OF(rgetsockname, *b);
	CHECK_SIN(&n, "10.0.0.2", PORT_DG_B);

	STAGE("datagrams: a port another socket holds");
	int x = dg_new();
	struct sockaddr_in at = sin_of("10.0.0.1", PORT_DG_A);
	CHECK_ERR(rbind(x, (struct sockaddr *)&at, sizeof at), EADDRINUSE);
	at = sin_of("10.0.0.2", PORT_DG_B);
	CHECK_ERR(rbind(x, (struct sockaddr *)&at, sizeof at), EADDRINUSE);
	CHECK_OK(rclose(x));

	STAGE("datagrams: the unspecified and loopback addresses");
	*any = dg_new();
	dg_bind(*any, "0.0.0.0", 0);
	n = NAME_OF(rgetsockname, *any);
	CHECK_SIN(&n, "0.0.0.0", -1);
	*lo = dg_new();
	dg_bind(*lo, "127.0.0.1", PORT_DG_LO);
	n = NAME_OF(rgetsockname, *lo);
	CHECK_SIN(&n, "127.0.0.1", PORT_DG_LO);
	printf("rsocket: datagram binding ok (0.0.0.0 took port %d)\n", dg_port(*any));
}

/* Datagrams of every size each way between a (10.0.0.1) and b (10.0.0.2), received whole
 * by blocking rrecvfrom into a larger buffer, with their sources. */
static void dgram_pingpong(int a, int b)
{
	static const size_t sizes[] = {1, 100, 1000, DG_MAX};
	static uint8_t out[DG_MAX], in[DG_MAX + 100];
	for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
		size_t n = sizes[i];
		STAGE("datagrams: ping (a to b)");
		fill(out, n, 200 + 2 * i);
		memset(in, 0, sizeof in);
		DG_SEND(a, out, n, "10.0.0.2", PORT_DG_B);
		if (i == 0)
			await_first(b, a, "10.0.0.1 to 10.0.0.2");
		DG_RECV(b, in, sizeof in, 0, n, "10.0.0.1", PORT_DG_A);
		CHECK_MEM(in, out, n);
		STAGE("datagrams: pong (b to a)");
		fill(out, n, 201 + 2 * i);
		memset(in, 0, sizeof in);
		DG_SEND(b, out, n, "10.0.0.1", PORT_DG_A);
		if (i == 0)
			await_first(a, b, "10.0.0.2 to 10.0.0.1");
		DG_RECV(a, in, sizeof in, 0, n, "10.0.0.2", PORT_DG_B);
		CHECK_MEM(in, out, n);
	}
	printf("rsocket: datagram ping-pong ok\n");
}

/* DG_ROW datagrams of different sizes from a to b before b reads any: all of them, in
 * order (each begins with its sequence number). */
static void dgram_in_a_row(int a, int b)
{
	STAGE("datagrams: in a row");
	static uint8_t out[DG_MAX], in[DG_MAX];
	for (uint32_t i = 0; i < DG_ROW; i++) {
		size_t n = 4 + (i * 397) % (DG_MAX - 3);
		uint32_t seq = htonl(i);
		memcpy(out, &seq, 4);
		fill(out + 4, n - 4, 300 + i);
		DG_SEND(a, out, n, "10.0.0.2", PORT_DG_B);
	}
	STAGE("datagrams: in a row, received");
	for (uint32_t i = 0; i < DG_ROW; i++) {
		size_t n = 4 + (i * 397) % (DG_MAX - 3);
		memset(in, 0, sizeof in);
		struct sockaddr_in from;
		socklen_t len = sizeof from;
		errno = 0;
		ssize_t r = rrecvfrom(b, in, sizeof in, 0, (struct sockaddr *)&from, &len);
		uint32_t seq;
		memcpy(&seq, in, 4);
		if (r < 4 || ntohl(seq) != i)
			FAIL("datagram %u of %d: rrecvfrom returned %zd (errno %d: %s), sequence "
			     "number %u",
			     i, DG_ROW, r, errno, strerror(errno), r < 4 ? 0 : ntohl(seq));
		CHECK_EQ(r, n);
		CHECK_SIN(&from, "10.0.0.1", PORT_DG_A);
		fill(out + 4, n - 4, 300 + i);
		CHECK_MEM(in + 4, out + 4, n - 4);
	}
	/* No more. */
	CHECK_EQ(poll_one(b, POLLIN, 0), 0);
	char c;
	CHECK_ERR(rrecv(b, &c, 1, MSG_DONTWAIT), EAGAIN);
	printf("rsocket: %d datagrams in a row ok\n", DG_ROW);
}

/* EMSGSIZE, a buffer shorter than the datagram, MSG_PEEK. */
static void dgram_sizes_and_peek(int a, int b)
{
	STAGE("datagrams: EMSGSIZE");
	static uint8_t out[DG_MAX + 1], in[DG_MAX];
	struct sockaddr_in to = sin_of("10.0.0.2", PORT_DG_B);
	CHECK_ERR(rsendto(a, out, DG_MAX + 1, 0, (struct sockaddr *)&to, sizeof to), EMSGSIZE);
	CHECK_EQ(poll_one(b, POLLIN, 100), 0);

	STAGE("datagrams: truncated by a short buffer");
	fill(out, 100, 401);
	DG_SEND(a, out, 100, "10.0.0.2", PORT_DG_B);
	memset(in, 0, sizeof in);
	DG_RECV(b, in, 10, 0, 10, "10.0.0.1", PORT_DG_A);
	CHECK_MEM(in, out, 10);
	/* The rest of it went with it. */
	CHECK_ERR(rrecv(b, in, sizeof in, MSG_DONTWAIT), EAGAIN);
	/* The next one is whole. */
	fill(out, 50, 402);
	DG_SEND(a, out, 50, "10.0.0.2", PORT_DG_B);
	memset(in, 0, sizeof in);
	DG_RECV(b, in, sizeof in, 0, 50, "10.0.0.1", PORT_DG_A);
	CHECK_MEM(in, out, 50);

	STAGE("datagrams: MSG_PEEK");
	DG_SEND(a, "peek at me", 10, "10.0.0.2", PORT_DG_B);
	CHECK_EQ(poll_one(b, POLLIN, 2000), POLLIN);
	memset(in, 0, sizeof in);
	DG_RECV(b, in, sizeof in, MSG_PEEK, 10, "10.0.0.1", PORT_DG_A);
	CHECK_MEM(in, "peek at me", 10);
	/* Peeked again, part of it: still queued, still whole. */
	memset(in, 0, sizeof in);
	DG_RECV(b, in, 4, MSG_PEEK | MSG_DONTWAIT, 4, "10.0.0.1", PORT_DG_A);
	CHECK_MEM(in, "peek", 4);
	CHECK_EQ(poll_one(b, POLLIN, 0), POLLIN);
	memset(in, 0, sizeof in);
	DG_RECV(b, in, sizeof in, 0, 10, "10.0.0.1", PORT_DG_A);
	CHECK_MEM(in, "peek at me", 10);
	CHECK_ERR(rrecv(b, in, sizeof in, MSG_DONTWAIT), EAGAIN);
	printf("rsocket: datagram sizes and MSG_PEEK ok\n");
}

/* A sender that waits a while first (a blocking receive must wait for it). */
struct late {
	pthread_t t;
	int fd;
};

static void *late_main(void *arg)
{
	struct late *l = arg;
	usleep(200 * 1000);
	DG_SEND(l->fd, "late", 4, "10.0.0.2", PORT_DG_B);
	return NULL;
}

/* EAGAIN (MSG_DONTWAIT, O_NONBLOCK), rpoll, and a blocking receive that waits. */
static void dgram_nonblocking_and_polling(int a, int b)
{
	STAGE("datagrams: EAGAIN");
	char buf[64];
	CHECK_ERR(rrecv(b, buf, sizeof buf, MSG_DONTWAIT), EAGAIN);
	CHECK_ERR(rrecvfrom(b, buf, sizeof buf, MSG_DONTWAIT, NULL, NULL), EAGAIN);
	set_nonblocking(b, 1);
	CHECK_ERR(rrecv(b, buf, sizeof buf, 0), EAGAIN);
	struct sockaddr_in from;
	socklen_t len = sizeof from;
	CHECK_ERR(rrecvfrom(b, buf, sizeof buf, 0, (struct sockaddr *)&from, &len), EAGAIN);
	/* A non-blocking socket sends. */
	DG_SEND(b, "nb", 2, "10.0.0.1", PORT_DG_A);
	DG_RECV(a, buf, sizeof buf, 0, 2, "10.0.0.2", PORT_DG_B);
	CHECK_MEM(buf, "nb", 2);

	STAGE("datagrams: rpoll");
	CHECK_EQ(poll_one(b, POLLIN, 0), 0);
	CHECK_EQ(poll_one(b, POLLIN | POLLOUT, 0), POLLOUT);
	CHECK_EQ(poll_one(a, POLLOUT, 0), POLLOUT);
	double t0 = now_s();
	CHECK_EQ(poll_one(b, POLLIN, 200), 0);
	double waited = now_s() - t0;
	if (waited < 0.15)
		FAIL("rpoll(POLLIN, 200 ms) with nothing queued returned after %.3f s", waited);
	DG_SEND(a, "poll", 4, "10.0.0.2", PORT_DG_B);
	CHECK_EQ(poll_one(b, POLLIN, 2000), POLLIN);
	CHECK_EQ(poll_one(b, POLLIN | POLLOUT, 0), POLLIN | POLLOUT);
	DG_RECV(b, buf, sizeof buf, 0, 4, "10.0.0.1", PORT_DG_A);
	CHECK_MEM(buf, "poll", 4);
	CHECK_EQ(poll_one(b, POLLIN, 0), 0);
	CHECK_ERR(rrecv(b, buf, sizeof buf, 0), EAGAIN);
	set_nonblocking(b, 0);

	STAGE("datagrams: a blocking receive waits");
	struct late l = {.fd = a};
	t0 = now_s();
	CHECK_OK(pthread_create(&l.t, NULL, late_main, &l));
	DG_RECV(b, buf, sizeof buf, 0, 4, "10.0.0.1", PORT_DG_A);
	waited = now_s() - t0;
	CHECK_MEM(buf, "late", 4);
	CHECK_OK(pthread_join(l.t, NULL));
	if (waited < 0.15)
		FAIL("the blocking rrecvfrom returned after %.3f s, before the datagram was sent",
		     waited);
	printf("rsocket: datagram EAGAIN and rpoll ok\n");
}

/* Datagrams to a port nobody has bound: each rsendto returns the length, nothing comes
 * back, and the sockets go on as before. */
static void dgram_to_nobody(int a, int b)
{
	STAGE("datagrams: to a port nobody has bound");
	char buf[64];
	for (int i = 0; i < DG_ROW; i++)
		DG_SEND(a, "lost", 4, "10.0.0.2", PORT_DG_NOBODY);
	DG_SEND(b, "lost too", 8, "10.0.0.1", PORT_DG_NOBODY);
	CHECK_EQ(poll_one(a, POLLIN, 200), 0);
	CHECK_EQ(poll_one(b, POLLIN, 0), 0);
	CHECK_ERR(rrecv(a, buf, sizeof buf, MSG_DONTWAIT), EAGAIN);
	CHECK_ERR(rrecv(b, buf, sizeof buf, MSG_DONTWAIT), EAGAIN);
	CHECK_EQ(get_int(a, SOL_SOCKET, SO_ERROR), 0);

	STAGE("datagrams: after the lost ones");
	DG_SEND(a, "still here", 10, "10.0.0.2", PORT_DG_B);
	DG_RECV(b, buf, sizeof buf, 0, 10, "10.0.0.1", PORT_DG_A);
	CHECK_MEM(buf, "still here", 10);
	DG_SEND(b, "me too", 6, "10.0.0.1", PORT_DG_A);
	DG_RECV(a, buf, sizeof buf, 0, 6, "10.0.0.2", PORT_DG_B);
	CHECK_MEM(buf, "me too", 6);
	/* And more to nobody, between datagrams to b: only b's arrive, in order. */
	DG_SEND(a, "one", 3, "10.0.0.2", PORT_DG_B);
	DG_SEND(a, "lost", 4, "10.0.0.2", PORT_DG_NOBODY);
	DG_SEND(a, "two", 3, "10.0.0.2", PORT_DG_B);
	DG_RECV(b, buf, sizeof buf, 0, 3, "10.0.0.1", PORT_DG_A);
	CHECK_MEM(buf, "one", 3);
	DG_RECV(b, buf, sizeof buf, 0, 3, "10.0.0.1", PORT_DG_A);
	CHECK_MEM(buf, "two", 3);
	CHECK_EQ(poll_one(b, POLLIN, 200), 0);
	printf("rsocket: datagrams to nobody ok\n");
}

/* An unbound sender (bound by its first rsendto), the sockets bound to 0.0.0.0 and
 * 127.0.0.1, and datagrams between two sockets of one NIC: the sources they give. */
static void dgram_addresses(int a, int b, int any, int lo)
{
	STAGE("datagrams: an unbound sender");
	char buf[64];
	int u = dg_new();
	DG_SEND(u, "implicit", 8, "10.0.0.2", PORT_DG_B);
	struct sockaddr_in n = NAME_OF(rgetsockname, u);
	CHECK_SIN(&n, "0.0.0.0", -1);
	int up = ntohs(n.sin_port);
	await_dgram(b, u);
	DG_RECV(b, buf, sizeof buf, 0, 8, "10.0.0.1", up);
	CHECK_MEM(buf, "implicit", 8);
	/* The answer, to the source rrecvfrom gave. */
	DG_HOP(b, u, "answer", "10.0.0.1", up, "10.0.0.2", PORT_DG_B);

	STAGE("datagrams: to a new destination, in order");
	/* Three to a destination u has not resolved: they wait, then go in order. */
	DG_SEND(u, "first", 5, "10.0.0.1", PORT_DG_A);
	DG_SEND(u, "second", 6, "10.0.0.1", PORT_DG_A);
	DG_SEND(u, "third", 5, "10.0.0.1", PORT_DG_A);
	await_dgram(a, u);
	DG_RECV(a, buf, sizeof buf, 0, 5, "10.0.0.1", up);
	CHECK_MEM(buf, "first", 5);
	await_dgram(a, u);
	DG_RECV(a, buf, sizeof buf, 0, 6, "10.0.0.1", up);
	CHECK_MEM(buf, "second", 6);
	await_dgram(a, u);
	DG_RECV(a, buf, sizeof buf, 0, 5, "10.0.0.1", up);
	CHECK_MEM(buf, "third", 5);
	CHECK_OK(rclose(u));

	STAGE("datagrams: a socket bound to 0.0.0.0");
	int ap = dg_port(any);
	DG_HOP(b, any, "to any", "10.0.0.1", ap, "10.0.0.2", PORT_DG_B);
	DG_HOP(any, b, "from any", "10.0.0.2", PORT_DG_B, "10.0.0.1", ap);

	STAGE("datagrams: between two sockets of one NIC");
	DG_HOP(a, any, "same nic", "10.0.0.1", ap, "10.0.0.1", PORT_DG_A);
	DG_HOP(any, a, "back", "10.0.0.1", PORT_DG_A, "10.0.0.1", ap);

	STAGE("datagrams: a socket bound to 127.0.0.1");
	DG_HOP(b, lo, "to lo", "10.0.0.1", PORT_DG_LO, "10.0.0.2", PORT_DG_B);
	DG_HOP(lo, b, "from lo", "10.0.0.2", PORT_DG_B, "10.0.0.1", PORT_DG_LO);
	printf("rsocket: datagram addresses ok (an unbound sender took port %d)\n", up);
}

/* rconnect: b's default destination and only source becomes a (a third socket's datagram
 * to b is dropped); rsend, rwrite and rread on b. */
static void dgram_connected(int a, int b)
{
	STAGE("datagrams: a third sender, before b connects");
	char buf[64];
	int c = dg_new();
	dg_bind(c, "10.0.0.1", 0);
	int cp = dg_port(c);
	DG_HOP(c, b, "from c", "10.0.0.2", PORT_DG_B, "10.0.0.1", cp);

	STAGE("datagrams: rconnect");
	/* At once, even non-blocking. */
	set_nonblocking(b, 1);
	struct sockaddr_in pa = sin_of("10.0.0.1", PORT_DG_A);
	CHECK_OK(rconnect(b, (struct sockaddr *)&pa, sizeof pa));
	struct sockaddr_in n = NAME_OF(rgetpeername, b);
	CHECK_SIN(&n, "10.0.0.1", PORT_DG_A);
	n = NAME_OF(rgetsockname, b);
	CHECK_SIN(&n, "10.0.0.2", PORT_DG_B);

	STAGE("datagrams: only the peer's are received");
	DG_SEND(c, "dropped", 7, "10.0.0.2", PORT_DG_B);
	DG_SEND(a, "from a", 6, "10.0.0.2", PORT_DG_B);
	CHECK_EQ(poll_one(b, POLLIN, 2000), POLLIN);
	memset(buf, 0, sizeof buf);
	DG_RECV(b, buf, sizeof buf, 0, 6, "10.0.0.1", PORT_DG_A);
	CHECK_MEM(buf, "from a", 6);
	CHECK_EQ(poll_one(b, POLLIN, 200), 0);
	CHECK_ERR(rrecv(b, buf, sizeof buf, 0), EAGAIN);

	STAGE("datagrams: rsend, rwrite, rread on the connected socket");
	CHECK_EQ(rsend(b, "rsend", 5, 0), 5);
	DG_RECV(a, buf, sizeof buf, 0, 5, "10.0.0.2", PORT_DG_B);
	CHECK_MEM(buf, "rsend", 5);
	CHECK_EQ(rwrite(b, "rwrite", 6), 6);
	DG_RECV(a, buf, sizeof buf, 0, 6, "10.0.0.2", PORT_DG_B);
	CHECK_MEM(buf, "rwrite", 6);
	DG_SEND(a, "rread", 5, "10.0.0.2", PORT_DG_B);
	CHECK_EQ(poll_one(b, POLLIN, 2000), POLLIN);
	memset(buf, 0, sizeof buf);
	CHECK_EQ(rread(b, buf, sizeof buf), 5);
	CHECK_MEM(buf, "rread", 5);
	/* c's, once more, is dropped too. */
	DG_SEND(c, "dropped", 7, "10.0.0.2", PORT_DG_B);
	CHECK_EQ(poll_one(b, POLLIN, 200), 0);
	CHECK_ERR(rrecvfrom(b, buf, sizeof buf, 0, NULL, NULL), EAGAIN);
	set_nonblocking(b, 0);
	CHECK_OK(rclose(c));
	printf("rsocket: connected datagram socket ok\n");
}

static void datagrams(void)
{
	dgram_sockets();
	int a, b, any, lo;
	dgram_binding(&a, &b, &any, &lo);
	dgram_pingpong(a, b);
	dgram_in_a_row(a, b);
	dgram_sizes_and_peek(a, b);
	dgram_nonblocking_and_polling(a, b);
	dgram_to_nobody(a, b);
	dgram_addresses(a, b, any, lo);
	dgram_connected(a, b);
	STAGE("datagrams: closing");
	int fds[] = {a, b, any, lo};
	for (size_t i = 0; i < sizeof fds / sizeof fds[0]; i++)
		CHECK_OK(rclose(fds[i]));
	for (size_t i = 0; i < sizeof fds / sizeof fds[0]; i++)
		CHECK_ERR(rclose(fds[i]), EBADF);
	printf("rsocket: datagrams %s\n",
	       soft_failures ? "done, with failed checks (on stderr)" : "ok");
}

int main(void)
{
	signal(SIGPIPE, SIG_IGN);
	signal(SIGALRM, on_alarm);
	alarm(55);
	setvbuf(stdout, NULL, _IONBF, 0);

	descriptors();
	binding();
	int c1, s1, c2, s2;
	int l = connections(&c1, &s1, &c2, &s2);
	data(c1, s1);
	data(c2, s2); /* between the NICs */
	peek(c2, s2);
	interrupted(c2, s2);
	int lnb = nonblocking_and_polling(c2, s2);
	nonblocking_connect(lnb);
	refusals();
	end_of_stream(l);
	options();
	iomap();

	STAGE("closing");
	int fds[] = {c1, s1, c2, s2, lnb, l};
	for (size_t i = 0; i < sizeof fds / sizeof fds[0]; i++)
		CHECK_OK(rclose(fds[i]));
	for (size_t i = 0; i < sizeof fds / sizeof fds[0]; i++)
		CHECK_ERR(rclose(fds[i]), EBADF);

	datagrams();
	if (soft_failures)
		FAIL("%d check(s) failed (above)", soft_failures);
	printf("rsocket: ok\n");
	return 0;
}
