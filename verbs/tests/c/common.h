/* Helpers shared by the C test programs of libringbell_verbs.so.
 *
 * Each program is an ordinary libibverbs program (compiled against rdma-core's
 * <infiniband/verbs.h>, linked with -libverbs) run with LD_PRELOAD=libringbell_verbs.so:
 * rb0 and rb1 are the two NICs of the library's in-process emulated fabric. A failed
 * check prints file:line, the expression, the values and errno, then exits 1.
 */
#ifndef RINGBELL_VERBS_TEST_COMMON_H
#define RINGBELL_VERBS_TEST_COMMON_H

#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <inttypes.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ---- checks ---- */

#define FAIL(...)                                                                        \
	do {                                                                             \
		fprintf(stderr, "%s:%d: ", __FILE__, __LINE__);                          \
		fprintf(stderr, __VA_ARGS__);                                            \
		fprintf(stderr, "\n");                                                   \
		exit(1);                                                                 \
	} while (0)

/* A condition that must hold; errno is printed as a hint. */
#define CHECK(cond)                                                                      \
	do {                                                                             \
		if (!(cond)) {                                                           \
			int e_ = errno;                                                  \
			FAIL("CHECK(%s) failed (errno %d: %s)", #cond, e_, strerror(e_)); \
		}                                                                        \
	} while (0)

/* Two integers that must be equal. */
#define CHECK_EQ(a, b)                                                                   \
	do {                                                                             \
		long long a_ = (long long)(a), b_ = (long long)(b);                      \
		if (a_ != b_) {                                                          \
			int e_ = errno;                                                  \
			FAIL("CHECK_EQ(%s, %s) failed: %lld (0x%llx) != %lld (0x%llx) "  \
			     "(errno %d: %s)",                                           \
			     #a, #b, a_, (unsigned long long)a_, b_,                     \
			     (unsigned long long)b_, e_, strerror(e_));                  \
		}                                                                        \
	} while (0)

/* A call that returns 0 on success and an errno value (or -1 with errno) otherwise. */
#define CHECK_OK(expr)                                                                   \
	do {                                                                             \
		errno = 0;                                                               \
		int r_ = (expr);                                                         \
		if (r_ != 0) {                                                           \
			int e_ = errno;                                                  \
			FAIL("%s returned %d (%s), errno %d (%s)", #expr, r_,            \
			     strerror(r_ > 0 ? r_ : e_), e_, strerror(e_));              \
		}                                                                        \
	} while (0)

/* A call that returns an errno value directly (the libibverbs style of ibv_modify_qp,
 * ibv_dealloc_pd, ...), which must be `want`. */
#define CHECK_RET(expr, want)                                                            \
	do {                                                                             \
		errno = 0;                                                               \
		int r_ = (expr);                                                         \
		if (r_ != (want)) {                                                      \
			int e_ = errno;                                                  \
			FAIL("%s returned %d (%s), want %d (%s); errno %d", #expr, r_,   \
			     strerror(r_ < 0 ? -r_ : r_), (int)(want),                   \
			     strerror(want), e_);                                        \
		}                                                                        \
	} while (0)

/* A call that must fail by returning NULL with errno `want`. */
#define CHECK_NULL_ERRNO(expr, want)                                                     \
	do {                                                                             \
		errno = 0;                                                               \
		void *p_ = (void *)(expr);                                               \
		int e_ = errno;                                                          \
		if (p_ != NULL)                                                          \
			FAIL("%s returned %p, want NULL with errno %d (%s)", #expr, p_,  \
			     (int)(want), strerror(want));                               \
		if (e_ != (want))                                                        \
			FAIL("%s: errno %d (%s), want %d (%s)", #expr, e_, strerror(e_), \
			     (int)(want), strerror(want));                               \
	} while (0)

/* A check the library fails today: a library bug, described in the commit that added the
 * check, with the fix it needs. With RINGBELL_VERBS_STRICT=1 in the environment it fails
 * like CHECK; otherwise it prints "KNOWN LIBRARY BUG" (which the Rust harness repeats) and
 * the program goes on. Once the library is fixed it prints "KNOWN LIBRARY BUG FIXED", and
 * the marker should become a plain CHECK. */
#define KNOWN_BUG(cond, ...)                                                             \
	do {                                                                             \
		const char *strict_ = getenv("RINGBELL_VERBS_STRICT");                   \
		if (!(cond)) {                                                           \
			fprintf(stderr, "%s:%d: KNOWN LIBRARY BUG: ", __FILE__, __LINE__); \
			fprintf(stderr, __VA_ARGS__);                                    \
			fprintf(stderr, "\n");                                           \
			if (strict_ && strcmp(strict_, "0") != 0)                        \
				exit(1);                                                 \
		} else {                                                                 \
			fprintf(stderr, "%s:%d: KNOWN LIBRARY BUG FIXED: ", __FILE__,    \
				__LINE__);                                               \
			fprintf(stderr, __VA_ARGS__);                                    \
			fprintf(stderr, "\n");                                           \
		}                                                                        \
	} while (0)

#define CHECK_MEM(a, b, n)                                                               \
	do {                                                                             \
		const unsigned char *x_ = (const void *)(a), *y_ = (const void *)(b);    \
		size_t n_ = (n);                                                         \
		for (size_t i_ = 0; i_ < n_; i_++)                                       \
			if (x_[i_] != y_[i_])                                            \
				FAIL("CHECK_MEM(%s, %s, %zu): byte %zu is 0x%02x, want " \
				     "0x%02x",                                           \
				     #a, #b, n_, i_, x_[i_], y_[i_]);                    \
	} while (0)

/* ---- completions ---- */

static inline double now_s(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

/* How long a test waits for something the fabric should do (it runs in lockstep with
 * the polls, so anything that happens at all happens in far less). */
#define WAIT_S 3.0

static inline const char *wc_status_name(int s)
{
	return ibv_wc_status_str((enum ibv_wc_status)s);
}

/* Polls `cq` until it returns one completion (which is stored in *wc); fails after WAIT_S. */
#define POLL_ONE(cq, wc) poll_one_at(__FILE__, __LINE__, (cq), (wc))
static inline void poll_one_at(const char *file, int line, struct ibv_cq *cq,
			       struct ibv_wc *wc)
{
	double end = now_s() + WAIT_S;
	for (;;) {
		int n = ibv_poll_cq(cq, 1, wc);
		if (n == 1)
			return;
		if (n != 0) {
			fprintf(stderr, "%s:%d: ibv_poll_cq returned %d\n", file, line, n);
			exit(1);
		}
		if (now_s() > end) {
			fprintf(stderr, "%s:%d: no completion within %.0f s\n", file, line,
				WAIT_S);
			exit(1);
		}
	}
}

/* Polls `cq` for one completion that must have status `st` and opcode `op`. */
#define EXPECT_WC(cq, wc, st, op)                                                        \
	do {                                                                             \
		poll_one_at(__FILE__, __LINE__, (cq), (wc));                             \
		if ((int)(wc)->status != (int)(st))                                      \
			FAIL("completion wr_id %" PRIu64 ": status %d (%s), want %d (%s)", \
			     (uint64_t)(wc)->wr_id, (int)(wc)->status,                   \
			     wc_status_name((wc)->status), (int)(st),                    \
			     wc_status_name(st));                                        \
		if ((int)(op) >= 0 && (int)(wc)->opcode != (int)(op))                    \
			FAIL("completion wr_id %" PRIu64 ": opcode %d, want %d",         \
			     (uint64_t)(wc)->wr_id, (int)(wc)->opcode, (int)(op));       \
	} while (0)

/* Polls `cq` `times` times (each empty poll steps the fabric) and fails if anything came. */
#define EXPECT_NO_WC(cq, times)                                                          \
	do {                                                                             \
		struct ibv_wc w_;                                                        \
		for (int i_ = 0; i_ < (times); i_++) {                                   \
			int n_ = ibv_poll_cq((cq), 1, &w_);                              \
			if (n_ != 0)                                                     \
				FAIL("unexpected completion (n %d): wr_id %" PRIu64      \
				     " status %d opcode %d",                             \
				     n_, (uint64_t)w_.wr_id, (int)w_.status,             \
				     (int)w_.opcode);                                    \
		}                                                                        \
	} while (0)

/* Steps the fabric `times` times by polling `empty`, a CQ that nothing reports to (an
 * empty poll of one entry gives the fabric one step; a poll of 0 entries does not). */
static inline void step(struct ibv_cq *empty, int times)
{
	struct ibv_wc w;
	for (int i = 0; i < times; i++)
		if (ibv_poll_cq(empty, 1, &w) != 0)
			FAIL("step: a completion on the stepping CQ (wr_id %" PRIu64 ")",
			     (uint64_t)w.wr_id);
}

/* Extended CQ: start_poll until it finds an entry or WAIT_S passes (then fails). Leaves
 * the poll open (the caller ends it). */
#define START_POLL(cqx) start_poll_at(__FILE__, __LINE__, (cqx))
static inline void start_poll_at(const char *file, int line, struct ibv_cq_ex *cqx)
{
	struct ibv_poll_cq_attr attr = {0};
	double end = now_s() + WAIT_S;
	for (;;) {
		int r = ibv_start_poll(cqx, &attr);
		if (r == 0)
			return;
		if (r != ENOENT) {
			fprintf(stderr, "%s:%d: ibv_start_poll returned %d\n", file, line, r);
			exit(1);
		}
		if (now_s() > end) {
			fprintf(stderr, "%s:%d: no completion within %.0f s\n", file, line,
				WAIT_S);
			exit(1);
		}
	}
}

/* ---- devices ---- */

/* Opens the ringbell device `name` ("rb0", "rb1"). */
static inline struct ibv_context *open_dev(const char *name)
{
	int n = 0;
	struct ibv_device **list = ibv_get_device_list(&n);
	CHECK(list != NULL);
	struct ibv_context *ctx = NULL;
	for (int i = 0; i < n; i++)
		if (strcmp(ibv_get_device_name(list[i]), name) == 0)
			ctx = ibv_open_device(list[i]);
	ibv_free_device_list(list);
	if (!ctx)
		FAIL("cannot open %s (is LD_PRELOAD=libringbell_verbs.so set?)", name);
	return ctx;
}

static inline union ibv_gid gid_of(struct ibv_context *ctx)
{
	union ibv_gid g;
	CHECK_OK(ibv_query_gid(ctx, 1, 0, &g));
	return g;
}

/* ---- an RC pair ---- */

#define ACC_ALL                                                                          \
	(IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |      \
	 IBV_ACCESS_REMOTE_ATOMIC)

/* One end: a context, a PD, a CQ, a buffer registered with every access, and a QP. */
struct side {
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_cq *cq;
	struct ibv_qp *qp;
	struct ibv_mr *mr;
	uint8_t *buf;
	size_t len;
	union ibv_gid gid;
};

/* How a QP is made and connected. */
struct qp_opts {
	uint32_t max_send_wr, max_recv_wr, max_send_sge, max_recv_sge, max_inline;
	int sq_sig_all;
	struct ibv_srq *srq;
	/* ibv_create_qp_ex with IBV_QP_INIT_ATTR_SEND_OPS_FLAGS (the ibv_wr_* builder), with
	 * these send operations beside the seven basic ones. */
	int ex;
	uint64_t more_send_ops;
	uint8_t rnr_retry, retry_cnt, min_rnr_timer, timeout;
	uint8_t max_rd_atomic;
	uint32_t sq_psn, rq_psn;
};

static inline struct qp_opts default_qp_opts(void)
{
	struct qp_opts o = {
		.max_send_wr = 64,
		.max_recv_wr = 64,
		.max_send_sge = 4,
		.max_recv_sge = 4,
		.max_inline = 64,
		.rnr_retry = 7,
		.retry_cnt = 7,
		.min_rnr_timer = 1,
		.timeout = 14,
		.max_rd_atomic = 4,
		.sq_psn = 0x100,
		.rq_psn = 0x100,
	};
	return o;
}

/* Opens `dev` and makes a PD, a CQ of `cqe` entries and a registered buffer of `len`
 * bytes (malloc'd). No QP yet. */
static inline void side_open(struct side *s, const char *dev, size_t len, int cqe)
{
	memset(s, 0, sizeof(*s));
	s->ctx = open_dev(dev);
	s->gid = gid_of(s->ctx);
	s->pd = ibv_alloc_pd(s->ctx);
	CHECK(s->pd != NULL);
	s->cq = ibv_create_cq(s->ctx, cqe, NULL, NULL, 0);
	CHECK(s->cq != NULL);
	s->len = len;
	s->buf = malloc(len);
	CHECK(s->buf != NULL);
	memset(s->buf, 0, len);
	s->mr = ibv_reg_mr(s->pd, s->buf, len, ACC_ALL);
	CHECK(s->mr != NULL);
}

/* An RC QP on the side's PD and CQ (both directions). */
static inline struct ibv_qp *side_qp(struct side *s, const struct qp_opts *o)
{
	struct ibv_qp *qp;
	struct ibv_qp_cap cap = {
		.max_send_wr = o->max_send_wr,
		.max_recv_wr = o->srq ? 0 : o->max_recv_wr,
		.max_send_sge = o->max_send_sge,
		.max_recv_sge = o->srq ? 0 : o->max_recv_sge,
		.max_inline_data = o->max_inline,
	};
	if (o->ex) {
		struct ibv_qp_init_attr_ex a = {
			.send_cq = s->cq,
			.recv_cq = s->cq,
			.srq = o->srq,
			.cap = cap,
			.qp_type = IBV_QPT_RC,
			.sq_sig_all = o->sq_sig_all,
			.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
			.pd = s->pd,
			.send_ops_flags = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM |
					  IBV_QP_EX_WITH_RDMA_WRITE |
					  IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM |
					  IBV_QP_EX_WITH_RDMA_READ |
					  IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP |
					  IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD | o->more_send_ops,
		};
		qp = ibv_create_qp_ex(s->ctx, &a);
	} else {
		struct ibv_qp_init_attr a = {
			.send_cq = s->cq,
			.recv_cq = s->cq,
			.srq = o->srq,
			.cap = cap,
			.qp_type = IBV_QPT_RC,
			.sq_sig_all = o->sq_sig_all,
		};
		qp = ibv_create_qp(s->pd, &a);
	}
	CHECK(qp != NULL);
	s->qp = qp;
	return qp;
}

static inline void qp_to_init(struct ibv_qp *qp)
{
	struct ibv_qp_attr a = {
		.qp_state = IBV_QPS_INIT,
		.pkey_index = 0,
		.port_num = 1,
		.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
				   IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC,
	};
	CHECK_RET(ibv_modify_qp(qp, &a,
				IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
					IBV_QP_ACCESS_FLAGS),
		  0);
}

/* The RTR attributes of a QP talking to `dest_qpn` at `dgid`. */
static inline struct ibv_qp_attr rtr_attr(uint32_t dest_qpn, const union ibv_gid *dgid,
					  const struct qp_opts *o)
{
	struct ibv_qp_attr a = {
		.qp_state = IBV_QPS_RTR,
		.path_mtu = IBV_MTU_1024,
		.dest_qp_num = dest_qpn,
		.rq_psn = o->rq_psn,
		.max_dest_rd_atomic = o->max_rd_atomic,
		.min_rnr_timer = o->min_rnr_timer,
	};
	a.ah_attr.is_global = 1;
	a.ah_attr.grh.dgid = *dgid;
	a.ah_attr.grh.sgid_index = 0;
	a.ah_attr.grh.hop_limit = 64;
	a.ah_attr.port_num = 1;
	return a;
}

#define RTR_MASK                                                                         \
	(IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |    \
	 IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER)
#define RTS_MASK                                                                         \
	(IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | \
	 IBV_QP_MAX_QP_RD_ATOMIC)

static inline void qp_to_rtr(struct ibv_qp *qp, uint32_t dest_qpn, const union ibv_gid *dgid,
			     const struct qp_opts *o)
{
	struct ibv_qp_attr a = rtr_attr(dest_qpn, dgid, o);
	CHECK_RET(ibv_modify_qp(qp, &a, RTR_MASK), 0);
}

static inline void qp_to_rts(struct ibv_qp *qp, const struct qp_opts *o)
{
	struct ibv_qp_attr a = {
		.qp_state = IBV_QPS_RTS,
		.timeout = o->timeout,
		.retry_cnt = o->retry_cnt,
		.rnr_retry = o->rnr_retry,
		.sq_psn = o->sq_psn,
		.max_rd_atomic = o->max_rd_atomic,
	};
	CHECK_RET(ibv_modify_qp(qp, &a, RTS_MASK), 0);
}

/* RESET -> INIT -> RTR -> RTS towards `dest_qpn` at `dgid`. */
static inline void qp_connect(struct ibv_qp *qp, uint32_t dest_qpn, const union ibv_gid *dgid,
			      const struct qp_opts *o)
{
	qp_to_init(qp);
	qp_to_rtr(qp, dest_qpn, dgid, o);
	qp_to_rts(qp, o);
}

/* Connects the QPs of two sides to each other (a's options for a, b's for b). */
static inline void sides_connect(struct side *a, const struct qp_opts *oa, struct side *b,
				 const struct qp_opts *ob)
{
	qp_connect(a->qp, b->qp->qp_num, &b->gid, oa);
	qp_connect(b->qp, a->qp->qp_num, &a->gid, ob);
}

/* A connected pair: `a` on rb0 and `b` on rb1 (or both on rb0 when `same_nic`), each with a
 * buffer of `len` bytes, a CQ of `cqe` entries and a QP made with `o`. */
static inline void pair_open(struct side *a, struct side *b, int same_nic, size_t len, int cqe,
			     const struct qp_opts *o)
{
	side_open(a, "rb0", len, cqe);
	side_open(b, same_nic ? "rb0" : "rb1", len, cqe);
	side_qp(a, o);
	side_qp(b, o);
	sides_connect(a, o, b, o);
}

/* Destroys what side_open and side_qp made (in the order libibverbs requires). */
static inline void side_close(struct side *s)
{
	if (s->qp)
		CHECK_RET(ibv_destroy_qp(s->qp), 0);
	CHECK_RET(ibv_dereg_mr(s->mr), 0);
	CHECK_RET(ibv_destroy_cq(s->cq), 0);
	CHECK_RET(ibv_dealloc_pd(s->pd), 0);
	CHECK_RET(ibv_close_device(s->ctx), 0);
	free(s->buf);
	memset(s, 0, sizeof(*s));
}

/* ---- posting ---- */

static inline void post_recv(struct ibv_qp *qp, uint64_t wr_id, void *addr, uint32_t len,
			     uint32_t lkey)
{
	struct ibv_sge sge = {.addr = (uintptr_t)addr, .length = len, .lkey = lkey};
	struct ibv_recv_wr wr = {.wr_id = wr_id, .sg_list = &sge, .num_sge = 1}, *bad = NULL;
	CHECK_RET(ibv_post_recv(qp, &wr, &bad), 0);
}

static inline void post_srq_recv(struct ibv_srq *srq, uint64_t wr_id, void *addr,
				 uint32_t len, uint32_t lkey)
{
	struct ibv_sge sge = {.addr = (uintptr_t)addr, .length = len, .lkey = lkey};
	struct ibv_recv_wr wr = {.wr_id = wr_id, .sg_list = &sge, .num_sge = 1}, *bad = NULL;
	CHECK_RET(ibv_post_srq_recv(srq, &wr, &bad), 0);
}

/* A signaled SEND of `len` bytes at `addr`. */
static inline void post_send_buf(struct ibv_qp *qp, uint64_t wr_id, void *addr, uint32_t len,
				 uint32_t lkey)
{
	struct ibv_sge sge = {.addr = (uintptr_t)addr, .length = len, .lkey = lkey};
	struct ibv_send_wr wr = {
		.wr_id = wr_id,
		.sg_list = &sge,
		.num_sge = 1,
		.opcode = IBV_WR_SEND,
		.send_flags = IBV_SEND_SIGNALED,
	};
	struct ibv_send_wr *bad = NULL;
	CHECK_RET(ibv_post_send(qp, &wr, &bad), 0);
}

/* Fills `n` bytes with a pattern that depends on `seed`. */
static inline void fill(void *p, size_t n, unsigned seed)
{
	unsigned char *b = p;
	for (size_t i = 0; i < n; i++)
		b[i] = (unsigned char)(seed * 31 + i * 7 + (i >> 8));
}

/* Reads the async events queued on a context whose async_fd is non-blocking, stepping the
 * fabric through `tick` (an empty CQ, see step) meanwhile, until one of type `want`
 * arrives (returned in *ev, not yet acknowledged) or `seconds` pass (returns 0). Other events are acknowledged and skipped. */
static inline int wait_async_for(struct ibv_context *ctx, struct ibv_cq *tick,
				 enum ibv_event_type want, struct ibv_async_event *ev,
				 double seconds)
{
	double end = now_s() + seconds;
	while (now_s() < end) {
		if (ibv_get_async_event(ctx, ev) == 0) {
			if (ev->event_type == want)
				return 1;
			ibv_ack_async_event(ev);
			continue;
		}
		if (errno != EAGAIN)
			FAIL("ibv_get_async_event: errno %d (%s)", errno, strerror(errno));
		step(tick, 1);
	}
	return 0;
}

static inline int wait_async(struct ibv_context *ctx, struct ibv_cq *tick,
			     enum ibv_event_type want, struct ibv_async_event *ev)
{
	return wait_async_for(ctx, tick, want, ev, WAIT_S);
}

/* An IPv4 socket address (the programs of the RDMA-CM and rsocket tests). */
static inline struct sockaddr_in sin_of(const char *ip, int port)
{
	struct sockaddr_in s;
	memset(&s, 0, sizeof s);
	s.sin_family = AF_INET;
	s.sin_port = htons(port);
	CHECK_EQ(inet_pton(AF_INET, ip, &s.sin_addr), 1);
	return s;
}

static inline void set_nonblock(int fd)
{
	int fl = fcntl(fd, F_GETFL);
	CHECK(fl >= 0);
	CHECK(fcntl(fd, F_SETFL, fl | O_NONBLOCK) == 0);
}

#endif
