/* Completion queues: sizes (1, max_cqe, beyond), comp_vector; completion channels (blocking
 * and non-blocking ibv_get_cq_event, a pollable fd, solicited-only arming, a signal handler
 * interrupting a blocking wait with or without SA_RESTART, EBUSY while a CQ
 * uses the channel); EBUSY for a CQ a QP uses; a CQ overflow reported as IBV_EVENT_CQ_ERR;
 * the extended CQ (ibv_create_cq_ex, ibv_start_poll/next_poll/end_poll and the readers);
 * ibv_resize_cq (completions waiting move with the CQ, a size below them is EINVAL). */
#include "common.h"
#include <pthread.h>
#include <signal.h>

static struct side a, b;
static struct qp_opts o;

/* A SEND of `len` bytes from a to b (b has a receive posted by the caller). */
static void send_a_to_b(uint64_t wr_id, uint32_t len, int flags)
{
	struct ibv_sge sge = {.addr = (uintptr_t)a.buf, .length = len, .lkey = a.mr->lkey};
	struct ibv_send_wr wr = {
		.wr_id = wr_id,
		.sg_list = &sge,
		.num_sge = 1,
		.opcode = IBV_WR_SEND,
		.send_flags = IBV_SEND_SIGNALED | flags,
	};
	struct ibv_send_wr *bad = NULL;
	CHECK_RET(ibv_post_send(a.qp, &wr, &bad), 0);
}

static void sizes(void)
{
	struct ibv_device_attr da;
	CHECK_RET(ibv_query_device(a.ctx, &da), 0);
	struct ibv_cq *cq = ibv_create_cq(a.ctx, 1, NULL, NULL, 0);
	CHECK(cq != NULL);
	CHECK(cq->cqe >= 1);
	CHECK(cq->context == a.ctx);
	CHECK_RET(ibv_destroy_cq(cq), 0);
	CHECK_RET(ibv_destroy_cq(cq), EINVAL);

	cq = ibv_create_cq(a.ctx, da.max_cqe, NULL, NULL, 0);
	CHECK(cq != NULL);
	CHECK(cq->cqe >= da.max_cqe);
	CHECK_RET(ibv_destroy_cq(cq), 0);

	CHECK_NULL_ERRNO(ibv_create_cq(a.ctx, da.max_cqe + 1, NULL, NULL, 0), EINVAL);
	CHECK_NULL_ERRNO(ibv_create_cq(a.ctx, 0, NULL, NULL, 0), EINVAL);
	CHECK_NULL_ERRNO(ibv_create_cq(a.ctx, -1, NULL, NULL, 0), EINVAL);
	CHECK_EQ(a.ctx->num_comp_vectors, 1);
	CHECK_NULL_ERRNO(ibv_create_cq(a.ctx, 16, NULL, NULL, 1), EINVAL);
	CHECK_NULL_ERRNO(ibv_create_cq(a.ctx, 16, NULL, NULL, -1), EINVAL);
	CHECK_NULL_ERRNO(ibv_create_cq(NULL, 16, NULL, NULL, 0), EINVAL);
	/* A channel of another context is refused. */
	struct ibv_comp_channel *other = ibv_create_comp_channel(b.ctx);
	CHECK(other != NULL);
	CHECK_NULL_ERRNO(ibv_create_cq(a.ctx, 16, NULL, other, 0), EINVAL);
	CHECK_RET(ibv_destroy_comp_channel(other), 0);
	printf("  sizes: 1 and %d accepted, %d, 0 and comp_vector 1 refused\n", da.max_cqe,
	       da.max_cqe + 1);
}

struct waiter {
	struct ibv_comp_channel *ch;
	struct ibv_cq *cq;
	void *ctx;
	int rc;
};

/* SIGUSR1's handler counts its runs. */
static volatile sig_atomic_t handled;
static void on_usr1(int sig)
{
	(void)sig;
	handled++;
}

static void set_handler(int flags)
{
	struct sigaction sa = {.sa_handler = on_usr1, .sa_flags = flags};
	sigemptyset(&sa.sa_mask);
	CHECK_EQ(sigaction(SIGUSR1, &sa, NULL), 0);
}

/* Sends SIGUSR1 to `target` once it has had 50 ms to block; then, if asked, a SEND from a
 * to b 50 ms later. */
struct nudge {
	pthread_t target;
	int then_send;
	uint64_t wr_id;
};

static void *nudge_later(void *arg)
{
	struct nudge *n = arg;
	struct timespec ts = {.tv_nsec = 50 * 1000 * 1000};
	nanosleep(&ts, NULL);
	pthread_kill(n->target, SIGUSR1);
	if (n->then_send) {
		nanosleep(&ts, NULL);
		send_a_to_b(n->wr_id, 64, 0);
	}
	return NULL;
}

static void *wait_event(void *arg)
{
	struct waiter *w = arg;
	w->rc = ibv_get_cq_event(w->ch, &w->cq, &w->ctx);
	return NULL;
}

/* The CQ whose events come through `ch`: b's receive CQ (b's QP is recreated on it). */
static void channel(void)
{
	struct ibv_comp_channel *ch = ibv_create_comp_channel(b.ctx);
	CHECK(ch != NULL);
	CHECK(ch->fd >= 0);
	CHECK(ch->context == b.ctx);
	int cookie;
	struct ibv_cq *cq = ibv_create_cq(b.ctx, 16, &cookie, ch, 0);
	CHECK(cq != NULL);
	CHECK(cq->channel == ch);
	CHECK(cq->cq_context == &cookie);
	CHECK_RET(ibv_destroy_comp_channel(ch), EBUSY);
	/* A CQ of b's context that nothing reports to: polling it steps the fabric and routes
	 * b's NIC's events. */
	struct ibv_cq *tick = ibv_create_cq(b.ctx, 1, NULL, NULL, 0);
	CHECK(tick != NULL);

	/* b's QP reports receives on cq. */
	struct ibv_qp_init_attr ia = {
		.send_cq = b.cq,
		.recv_cq = cq,
		.cap = {.max_send_wr = 8, .max_recv_wr = 8, .max_send_sge = 1, .max_recv_sge = 1},
		.qp_type = IBV_QPT_RC,
	};
	struct ibv_qp *bq = ibv_create_qp(b.pd, &ia);
	CHECK(bq != NULL);
	CHECK_RET(ibv_destroy_cq(cq), EBUSY);
	struct ibv_qp *aq = side_qp(&a, &o);
	qp_connect(aq, bq->qp_num, &b.gid, &o);
	qp_connect(bq, aq->qp_num, &a.gid, &o);

	/* Blocking: the call steps the fabric until the event comes. */
	CHECK_OK(ibv_req_notify_cq(cq, 0));
	post_recv(bq, 1, b.buf, 64, b.mr->lkey);
	send_a_to_b(11, 64, 0);
	struct ibv_cq *ev_cq = NULL;
	void *ev_ctx = NULL;
	CHECK_OK(ibv_get_cq_event(ch, &ev_cq, &ev_ctx));
	CHECK(ev_cq == cq);
	CHECK(ev_ctx == &cookie);
	ibv_ack_cq_events(cq, 1);
	struct ibv_wc wc;
	EXPECT_WC(cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
	CHECK_EQ(wc.wr_id, 1);
	EXPECT_WC(a.cq, &wc, IBV_WC_SUCCESS, IBV_WC_SEND);

	/* Non-blocking: EAGAIN while nothing is queued, and poll() says readable once an event
	 * is. */
	set_nonblock(ch->fd);
	errno = 0;
	CHECK_EQ(ibv_get_cq_event(ch, &ev_cq, &ev_ctx), -1);
	CHECK_EQ(errno, EAGAIN);
	struct pollfd pfd = {.fd = ch->fd, .events = POLLIN};
	CHECK_EQ(poll(&pfd, 1, 0), 0);
	CHECK_OK(ibv_req_notify_cq(cq, 0));
	post_recv(bq, 2, b.buf, 64, b.mr->lkey);
	send_a_to_b(12, 64, 0);
	double end = now_s() + WAIT_S;
	while (poll(&pfd, 1, 0) == 0) {
		if (now_s() > end)
			FAIL("the channel's fd never became readable");
		step(tick, 1);
	}
	CHECK(pfd.revents & POLLIN);
	CHECK_OK(ibv_get_cq_event(ch, &ev_cq, &ev_ctx));
	CHECK(ev_cq == cq);
	CHECK(ev_ctx == &cookie);
	/* One event per arming: nothing more is queued. */
	errno = 0;
	CHECK_EQ(ibv_get_cq_event(ch, &ev_cq, &ev_ctx), -1);
	CHECK_EQ(errno, EAGAIN);
	CHECK_EQ(poll(&pfd, 1, 0), 0);
	ibv_ack_cq_events(cq, 1);
	EXPECT_WC(cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
	CHECK_EQ(wc.wr_id, 2);
	EXPECT_WC(a.cq, &wc, IBV_WC_SUCCESS, IBV_WC_SEND);

	/* Without arming, a completion raises no event. */
	post_recv(bq, 3, b.buf, 64, b.mr->lkey);
	send_a_to_b(13, 64, 0);
	EXPECT_WC(cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
	EXPECT_WC(a.cq, &wc, IBV_WC_SUCCESS, IBV_WC_SEND);
	step(tick, 200);
	errno = 0;
	CHECK_EQ(ibv_get_cq_event(ch, &ev_cq, &ev_ctx), -1);
	CHECK_EQ(errno, EAGAIN);

	/* Solicited only: an unsolicited SEND raises nothing, a solicited one does. */
	CHECK_OK(ibv_req_notify_cq(cq, 1));
	post_recv(bq, 4, b.buf, 64, b.mr->lkey);
	post_recv(bq, 5, b.buf, 64, b.mr->lkey);
	send_a_to_b(14, 64, 0);
	EXPECT_WC(a.cq, &wc, IBV_WC_SUCCESS, IBV_WC_SEND);
	step(tick, 200);
	errno = 0;
	CHECK_EQ(ibv_get_cq_event(ch, &ev_cq, &ev_ctx), -1);
	CHECK_EQ(errno, EAGAIN);
	send_a_to_b(15, 64, IBV_SEND_SOLICITED);
	EXPECT_WC(a.cq, &wc, IBV_WC_SUCCESS, IBV_WC_SEND);
	end = now_s() + WAIT_S;
	while (ibv_get_cq_event(ch, &ev_cq, &ev_ctx) != 0) {
		CHECK_EQ(errno, EAGAIN);
		if (now_s() > end)
			FAIL("no event for a solicited SEND on a CQ armed solicited-only");
		step(tick, 1);
	}
	CHECK(ev_cq == cq);
	ibv_ack_cq_events(cq, 1);
	EXPECT_WC(cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
	CHECK_EQ(wc.wr_id, 4);
	EXPECT_WC(cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
	CHECK_EQ(wc.wr_id, 5);

	/* Another thread blocked in ibv_get_cq_event (blocking fd again) wakes up when this
	 * thread's traffic completes. */
	{
		int fl = fcntl(ch->fd, F_GETFL);
		CHECK(fcntl(ch->fd, F_SETFL, fl & ~O_NONBLOCK) == 0);
		struct waiter w = {.ch = ch};
		CHECK_OK(ibv_req_notify_cq(cq, 0));
		pthread_t t;
		CHECK_EQ(pthread_create(&t, NULL, wait_event, &w), 0);
		post_recv(bq, 6, b.buf, 64, b.mr->lkey);
		send_a_to_b(16, 64, 0);
		EXPECT_WC(a.cq, &wc, IBV_WC_SUCCESS, IBV_WC_SEND);
		CHECK_EQ(pthread_join(t, NULL), 0);
		CHECK_EQ(w.rc, 0);
		CHECK(w.cq == cq);
		CHECK(w.ctx == &cookie);
		ibv_ack_cq_events(cq, 1);
		EXPECT_WC(cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
		CHECK_EQ(wc.wr_id, 6);
	}

	/* A signal handler that runs while ibv_get_cq_event blocks: without SA_RESTART the call
	 * fails with EINTR, as a read(2) of the uverbs descriptor does (qperf ends its tests
	 * with SIGALRM so); with SA_RESTART it goes on and returns the event that comes
	 * later. */
	{
		struct nudge n = {.target = pthread_self()};
		set_handler(0);
		CHECK_OK(ibv_req_notify_cq(cq, 0));
		pthread_t t;
		CHECK_EQ(pthread_create(&t, NULL, nudge_later, &n), 0);
		errno = 0;
		CHECK_EQ(ibv_get_cq_event(ch, &ev_cq, &ev_ctx), -1);
		CHECK_EQ(errno, EINTR);
		CHECK_EQ(pthread_join(t, NULL), 0);
		CHECK_EQ(handled, 1);

		/* SA_RESTART: the handler runs, the call waits on for the SEND posted after it. */
		set_handler(SA_RESTART);
		n.then_send = 1;
		n.wr_id = 17;
		post_recv(bq, 7, b.buf, 64, b.mr->lkey);
		CHECK_EQ(pthread_create(&t, NULL, nudge_later, &n), 0);
		CHECK_OK(ibv_get_cq_event(ch, &ev_cq, &ev_ctx));
		CHECK(ev_cq == cq);
		CHECK_EQ(handled, 2);
		CHECK_EQ(pthread_join(t, NULL), 0);
		ibv_ack_cq_events(cq, 1);
		EXPECT_WC(cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
		CHECK_EQ(wc.wr_id, 7);
		EXPECT_WC(a.cq, &wc, IBV_WC_SUCCESS, IBV_WC_SEND);
		signal(SIGUSR1, SIG_DFL);
	}

	/* Teardown order: QP, then CQ, then channel. */
	CHECK_RET(ibv_destroy_qp(bq), 0);
	CHECK_RET(ibv_destroy_qp(aq), 0);
	a.qp = NULL;
	CHECK_RET(ibv_destroy_comp_channel(ch), EBUSY);
	CHECK_RET(ibv_destroy_cq(cq), 0);
	CHECK_RET(ibv_destroy_comp_channel(ch), 0);
	CHECK_RET(ibv_destroy_comp_channel(ch), EINVAL);
	CHECK_RET(ibv_destroy_cq(tick), 0);
	printf("  channel: blocking, non-blocking, poll(), solicited-only, another thread, EINTR and SA_RESTART, EBUSY\n");
}

/* A send CQ of 2 entries and 8 signaled SENDs never polled: the CQ overflows, which the
 * device reports as IBV_EVENT_CQ_ERR on the context's async queue. */
static void overflow(void)
{
	struct ibv_cq *small = ibv_create_cq(a.ctx, 2, NULL, NULL, 0);
	CHECK(small != NULL);
	struct ibv_cq *tick = ibv_create_cq(a.ctx, 1, NULL, NULL, 0);
	CHECK(tick != NULL);
	int sends = small->cqe + 6;
	if (sends < 8)
		sends = 8;
	struct ibv_qp_init_attr ia = {
		.send_cq = small,
		.recv_cq = a.cq,
		.cap = {.max_send_wr = 64, .max_recv_wr = 8, .max_send_sge = 1, .max_recv_sge = 1},
		.qp_type = IBV_QPT_RC,
	};
	struct ibv_qp *aq = ibv_create_qp(a.pd, &ia);
	CHECK(aq != NULL);
	struct ibv_qp *bq = side_qp(&b, &o);
	qp_connect(aq, bq->qp_num, &b.gid, &o);
	qp_connect(bq, aq->qp_num, &a.gid, &o);
	for (int i = 0; i < sends; i++)
		post_recv(bq, 100 + i, b.buf, 64, b.mr->lkey);
	for (int i = 0; i < sends; i++) {
		struct ibv_sge sge = {.addr = (uintptr_t)a.buf, .length = 8, .lkey = a.mr->lkey};
		struct ibv_send_wr wr = {.wr_id = i,
					 .sg_list = &sge,
					 .num_sge = 1,
					 .opcode = IBV_WR_SEND,
					 .send_flags = IBV_SEND_SIGNALED};
		struct ibv_send_wr *bad = NULL;
		CHECK_RET(ibv_post_send(aq, &wr, &bad), 0);
	}
	/* Let every SEND arrive (b polls its receives) without polling `small`. */
	struct ibv_wc wc;
	for (int i = 0; i < sends; i++)
		EXPECT_WC(b.cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
	set_nonblock(a.ctx->async_fd);
	struct ibv_async_event ev;
	if (!wait_async(a.ctx, tick, IBV_EVENT_CQ_ERR, &ev))
		FAIL("no IBV_EVENT_CQ_ERR after %d completions into a CQ of %d entries", sends,
		     small->cqe);
	CHECK(ev.element.cq == small);
	ibv_ack_async_event(&ev);
	printf("  overflow: IBV_EVENT_CQ_ERR after %d completions into %d entries\n", sends,
	       small->cqe);
	/* Drain any other async events (the QP's error) before moving on. */
	while (ibv_get_async_event(a.ctx, &ev) == 0)
		ibv_ack_async_event(&ev);
	CHECK_RET(ibv_destroy_qp(aq), 0);
	CHECK_RET(ibv_destroy_qp(bq), 0);
	b.qp = NULL;
	CHECK_RET(ibv_destroy_cq(small), 0);
	CHECK_RET(ibv_destroy_cq(tick), 0);
}

/* The next entry of an open poll: next_poll reads what is in the ring without stepping
 * the fabric, so when it finds nothing the poll is ended and started again. */
static void next(struct ibv_cq_ex *cqx)
{
	int r = ibv_next_poll(cqx);
	if (r == ENOENT) {
		ibv_end_poll(cqx);
		START_POLL(cqx);
	} else {
		CHECK_EQ(r, 0);
	}
}

/* The extended CQ as b's receive CQ. */
static void extended(void)
{
	struct ibv_cq_init_attr_ex ca = {
		.cqe = 32,
		.cq_context = &ca,
		.wc_flags = IBV_WC_STANDARD_FLAGS | IBV_WC_EX_WITH_COMPLETION_TIMESTAMP |
			    IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK,
	};
	struct ibv_cq_ex *cqx = ibv_create_cq_ex(b.ctx, &ca);
	CHECK(cqx != NULL);
	struct ibv_cq *cq = ibv_cq_ex_to_cq(cqx);
	CHECK(cq->context == b.ctx);
	CHECK(cq->cq_context == &ca);

	/* Empty: ENOENT (and no end_poll needed). */
	struct ibv_poll_cq_attr pa = {0};
	CHECK_RET(ibv_start_poll(cqx, &pa), ENOENT);

	struct ibv_qp_init_attr ia = {
		.send_cq = b.cq,
		.recv_cq = cq,
		.cap = {.max_send_wr = 8, .max_recv_wr = 8, .max_send_sge = 1, .max_recv_sge = 1},
		.qp_type = IBV_QPT_RC,
	};
	struct ibv_qp *bq = ibv_create_qp(b.pd, &ia);
	CHECK(bq != NULL);
	struct ibv_qp *aq = side_qp(&a, &o);
	qp_connect(aq, bq->qp_num, &b.gid, &o);
	qp_connect(bq, aq->qp_num, &a.gid, &o);

	post_recv(bq, 21, b.buf, 256, b.mr->lkey);
	post_recv(bq, 22, b.buf + 256, 256, b.mr->lkey);
	post_recv(bq, 23, b.buf + 512, 256, b.mr->lkey);
	send_a_to_b(31, 100, 0);
	struct ibv_sge sge = {.addr = (uintptr_t)a.buf, .length = 77, .lkey = a.mr->lkey};
	struct ibv_send_wr wr = {
		.wr_id = 32,
		.sg_list = &sge,
		.num_sge = 1,
		.opcode = IBV_WR_SEND_WITH_IMM,
		.send_flags = IBV_SEND_SIGNALED,
		.imm_data = htonl(0xdeadbeef),
	};
	struct ibv_send_wr *bad = NULL;
	CHECK_RET(ibv_post_send(aq, &wr, &bad), 0);
	send_a_to_b(33, 5, 0);
	struct ibv_wc wc;
	for (int i = 0; i < 3; i++)
		EXPECT_WC(a.cq, &wc, IBV_WC_SUCCESS, IBV_WC_SEND);

	START_POLL(cqx);
	CHECK_EQ(cqx->status, IBV_WC_SUCCESS);
	CHECK_EQ(cqx->wr_id, 21);
	CHECK_EQ(ibv_wc_read_opcode(cqx), IBV_WC_RECV);
	CHECK_EQ(ibv_wc_read_byte_len(cqx), 100);
	CHECK_EQ(ibv_wc_read_qp_num(cqx), bq->qp_num);
	CHECK_EQ(ibv_wc_read_wc_flags(cqx) & IBV_WC_WITH_IMM, 0);
	uint64_t ts1 = ibv_wc_read_completion_ts(cqx);
	/* Real time: the device's time from the context's opening, in ns since the epoch. */
	uint64_t wall1 = ibv_wc_read_completion_wallclock_ns(cqx);
	struct timespec rt;
	clock_gettime(CLOCK_REALTIME, &rt);
	uint64_t now_ns = (uint64_t)rt.tv_sec * 1000000000ull + (uint64_t)rt.tv_nsec;
	CHECK(wall1 <= now_ns + 60000000000ull && wall1 + 3600000000000ull >= now_ns);
	next(cqx);
	CHECK_EQ(cqx->status, IBV_WC_SUCCESS);
	CHECK_EQ(cqx->wr_id, 22);
	CHECK_EQ(ibv_wc_read_opcode(cqx), IBV_WC_RECV);
	CHECK_EQ(ibv_wc_read_byte_len(cqx), 77);
	CHECK_EQ(ibv_wc_read_qp_num(cqx), bq->qp_num);
	CHECK(ibv_wc_read_wc_flags(cqx) & IBV_WC_WITH_IMM);
	CHECK_EQ(ibv_wc_read_imm_data(cqx), htonl(0xdeadbeef));
	uint64_t ts2 = ibv_wc_read_completion_ts(cqx);
	CHECK(ts2 >= ts1);
	CHECK_EQ(ibv_wc_read_completion_wallclock_ns(cqx) - wall1, ts2 / 1000 - ts1 / 1000);
	next(cqx);
	CHECK_EQ(cqx->wr_id, 23);
	CHECK_EQ(ibv_wc_read_byte_len(cqx), 5);
	CHECK_RET(ibv_next_poll(cqx), ENOENT);
	ibv_end_poll(cqx);
	CHECK_RET(ibv_start_poll(cqx, &pa), ENOENT);
	CHECK_MEM(b.buf, a.buf, 100);

	/* Unknown completion fields or creation flags are refused. */
	struct ibv_cq_init_attr_ex bad_attr = {.cqe = 4, .wc_flags = 1ull << 40};
	CHECK_NULL_ERRNO(ibv_create_cq_ex(b.ctx, &bad_attr), EOPNOTSUPP);
	struct ibv_cq_init_attr_ex bad_cqe = {.cqe = 0, .wc_flags = IBV_WC_STANDARD_FLAGS};
	CHECK_NULL_ERRNO(ibv_create_cq_ex(b.ctx, &bad_cqe), EINVAL);

	CHECK_RET(ibv_destroy_cq(cq), EBUSY);
	CHECK_RET(ibv_destroy_qp(bq), 0);
	CHECK_RET(ibv_destroy_qp(aq), 0);
	a.qp = NULL;
	CHECK_RET(ibv_destroy_cq(cq), 0);
	printf("  extended: start/next/end_poll, readers, ENOENT\n");
}

/* An 8-byte signaled WRITE from qp to b's buffer. */
static void write8(struct ibv_qp *qp, uint64_t wr_id)
{
	struct ibv_sge sge = {.addr = (uintptr_t)a.buf, .length = 8, .lkey = a.mr->lkey};
	struct ibv_send_wr wr = {.wr_id = wr_id, .sg_list = &sge, .num_sge = 1,
				 .opcode = IBV_WR_RDMA_WRITE, .send_flags = IBV_SEND_SIGNALED};
	wr.wr.rdma.remote_addr = (uintptr_t)b.buf;
	wr.wr.rdma.rkey = b.mr->rkey;
	struct ibv_send_wr *bad = NULL;
	CHECK_RET(ibv_post_send(qp, &wr, &bad), 0);
}

static void expect_writes(struct ibv_cq *cq, uint64_t first, uint64_t n)
{
	struct ibv_wc wc;
	for (uint64_t i = first; i < first + n; i++) {
		EXPECT_WC(cq, &wc, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE);
		CHECK_EQ(wc.wr_id, i);
	}
	EXPECT_NO_WC(cq, 10);
}

static void resize(void)
{
	struct ibv_device_attr da;
	CHECK_RET(ibv_query_device(a.ctx, &da), 0);
	struct ibv_cq *cq = ibv_create_cq(a.ctx, 4, NULL, NULL, 0);
	CHECK(cq != NULL);
	int c0 = cq->cqe;
	CHECK(c0 >= 4);
	CHECK_RET(ibv_resize_cq(cq, 0), EINVAL);
	CHECK_RET(ibv_resize_cq(cq, -1), EINVAL);
	CHECK_RET(ibv_resize_cq(cq, da.max_cqe + 1), EINVAL);
	CHECK_EQ(cq->cqe, c0);
	struct ibv_qp_init_attr ia = {
		.send_cq = cq,
		.recv_cq = cq,
		.cap = {.max_send_wr = 32, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1},
		.qp_type = IBV_QPT_RC,
	};
	struct ibv_qp *qa = ibv_create_qp(a.pd, &ia);
	CHECK(qa != NULL);
	ia.send_cq = ia.recv_cq = b.cq;
	struct ibv_qp *qb = ibv_create_qp(b.pd, &ia);
	CHECK(qb != NULL);
	qp_connect(qa, qb->qp_num, &b.gid, &o);
	qp_connect(qb, qa->qp_num, &a.gid, &o);
	/* Three WRITEs complete while the CQ grows: they move with it, in order. */
	for (uint64_t i = 0; i < 3; i++)
		write8(qa, i);
	CHECK_RET(ibv_resize_cq(cq, 100), 0);
	CHECK(cq->cqe >= 100);
	int grown = cq->cqe;
	expect_writes(cq, 0, 3);
	/* Five waiting do not fit in two entries: EINVAL, and the CQ is as it was. */
	for (uint64_t i = 3; i < 8; i++)
		write8(qa, i);
	CHECK_RET(ibv_resize_cq(cq, 2), EINVAL);
	CHECK_EQ(cq->cqe, grown);
	expect_writes(cq, 3, 5);
	/* Empty, it shrinks, and goes on. */
	CHECK_RET(ibv_resize_cq(cq, 2), 0);
	CHECK(cq->cqe >= 2 && cq->cqe < grown);
	write8(qa, 8);
	expect_writes(cq, 8, 1);
	CHECK_RET(ibv_destroy_qp(qa), 0);
	CHECK_RET(ibv_destroy_qp(qb), 0);
	CHECK_RET(ibv_destroy_cq(cq), 0);
	printf("  resize: grew to %d with 3 waiting, 5 waiting refused a shrink to 2\n", grown);
}

int main(void)
{
	alarm(30); /* a wait that never ends fails the program instead of hanging it */
	o = default_qp_opts();
	side_open(&a, "rb0", 1 << 16, 64);
	side_open(&b, "rb1", 1 << 16, 64);
	sizes();
	channel();
	overflow();
	extended();
	resize();
	side_close(&a);
	side_close(&b);
	printf("cq: ok\n");
	return 0;
}
