/* Counters, triggered operations and the deferred work queue of the ringbell provider,
 * through libfabric's own API (fi_cntr(3), fi_trigger(3), fi_mr(3)): two endpoints of one
 * process, on NICs rb0 and rb1 of the in-process fabric (RINGBELL_NICS=2), with the checks
 * and the summary line of ctest.h. */
#include "ctest.h"

#include <rdma/fi_trigger.h>

struct side {
	struct fid_domain *dom;
	struct fid_cq *cq;
	struct fid_av *av;
	struct fid_ep *ep;
	fi_addr_t peer;
	char name[64];
	size_t namelen;
};

static struct fid_fabric *fabric;
static struct side A, B;

static void *pages(size_t len) { return ct_pages(len); }

static void open_side(struct fi_info *info, struct side *s, struct fid_cntr **cntrs,
		      const uint64_t *flags, int ncntr)
{
	struct fi_cq_attr cq_attr = {.format = FI_CQ_FORMAT_TAGGED, .size = 256};
	struct fi_av_attr av_attr = {.type = FI_AV_TABLE};
	MUST(fi_domain(fabric, info, &s->dom, NULL));
	MUST(fi_cq_open(s->dom, &cq_attr, &s->cq, NULL));
	MUST(fi_av_open(s->dom, &av_attr, &s->av, NULL));
	MUST(fi_endpoint(s->dom, info, &s->ep, NULL));
	MUST(fi_ep_bind(s->ep, &s->av->fid, 0));
	MUST(fi_ep_bind(s->ep, &s->cq->fid, FI_TRANSMIT | FI_RECV));
	for (int i = 0; i < ncntr; i++) {
		struct fi_cntr_attr ca = {.events = FI_CNTR_EVENTS_COMP,
					  .wait_obj = FI_WAIT_UNSPEC};
		MUST(fi_cntr_open(s->dom, &ca, &cntrs[i], NULL));
		MUST(fi_ep_bind(s->ep, &cntrs[i]->fid, flags[i]));
	}
	MUST(fi_enable(s->ep));
	s->namelen = sizeof(s->name);
	MUST(fi_getname(&s->ep->fid, s->name, &s->namelen));
}

/* One completion of `cq`, or an error number (-FI_EAVAIL for an error entry), reading until
 * something comes or `tries` reads pass (-FI_EAGAIN). */
static ssize_t one(struct fid_cq *cq, struct fi_cq_tagged_entry *e, int tries)
{
	for (int i = 0; i < tries; i++) {
		ssize_t r = fi_cq_read(cq, e, 1);
		if (r != -FI_EAGAIN)
			return r == 1 ? 0 : r;
	}
	return -FI_EAGAIN;
}

/* The error entry waiting in `cq`. */
static int one_err(struct fid_cq *cq, struct fi_cq_err_entry *e)
{
	struct fi_cq_tagged_entry t;
	ssize_t r = one(cq, &t, 200000);
	if (r != -FI_EAVAIL)
		return (int)r;
	memset(e, 0, sizeof(*e));
	return fi_cq_readerr(cq, e, 0) == 1 ? 0 : -1;
}

/* Drives both sides (progress is manual: it comes with CQ reads). */
static void spin(int rounds)
{
	struct fi_cq_tagged_entry e;
	for (int i = 0; i < rounds; i++) {
		(void)fi_cq_read(A.cq, &e, 0);
		(void)fi_cq_read(B.cq, &e, 0);
	}
}

static struct fid_cntr *cntr(struct side *s)
{
	struct fi_cntr_attr ca = {.events = FI_CNTR_EVENTS_COMP, .wait_obj = FI_WAIT_UNSPEC};
	struct fid_cntr *c;
	MUST(fi_cntr_open(s->dom, &ca, &c, NULL));
	return c;
}

/* What deferred work compares its threshold with: success + error. */
static uint64_t level(struct fid_cntr *c)
{
	return fi_cntr_read(c) + fi_cntr_readerr(c);
}

static struct fid_mr *reg(struct side *s, void *buf, size_t len, uint64_t access)
{
	struct fid_mr *mr;
	MUST(fi_mr_reg(s->dom, buf, len, access, 0, 0, 0, &mr, NULL));
	return mr;
}

/* fi_cntr(3) on its own. */
static void test_counter_calls(void)
{
	struct fid_cntr *c = cntr(&A);
	CHECK_EQ(fi_cntr_read(c), 0);
	CHECK_EQ(fi_cntr_add(c, 5), 0);
	CHECK_EQ(fi_cntr_read(c), 5);
	CHECK_EQ(fi_cntr_adderr(c, 2), 0);
	CHECK_EQ(fi_cntr_readerr(c), 2);
	CHECK_EQ(fi_cntr_set(c, 1ULL << 40), 0);
	CHECK_EQ(fi_cntr_read(c), 1ULL << 40);
	CHECK_EQ(fi_cntr_seterr(c, 0), 0);
	CHECK_EQ(fi_cntr_readerr(c), 0);
	CHECK_EQ(fi_cntr_set(c, 10), 0);
	CHECK_EQ(fi_cntr_wait(c, 10, 0), 0);
	CHECK_EQ(fi_cntr_wait(c, 11, 20), -FI_ETIMEDOUT);
	CHECK_EQ(fi_cntr_adderr(c, 1), 0);
	/* fi_cntr_wait returns when the error value changes while it waits; here it has
	 * changed before: a wait started now sees the new value as its own. */
	CHECK_EQ(fi_cntr_wait(c, 11, 20), -FI_ETIMEDOUT);
	CHECK_EQ(fi_close(&c->fid), 0);

	struct fi_cntr_attr bad = {.events = (enum fi_cntr_events)7};
	struct fid_cntr *x = NULL;
	CHECK_EQ(fi_cntr_open(A.dom, &bad, &x, NULL), -FI_ENOSYS);
	bad.events = FI_CNTR_EVENTS_COMP;
	bad.wait_obj = FI_WAIT_POLLFD;
	CHECK_EQ(fi_cntr_open(A.dom, &bad, &x, NULL), -FI_ENOSYS);
	bad.wait_obj = FI_WAIT_UNSPEC;
	bad.flags = 1;
	CHECK_EQ(fi_cntr_open(A.dom, &bad, &x, NULL), -FI_EINVAL);
}

/* Endpoint counters: sends (injects too), receives, writes, reads, remote writes counted
 * on an MR's counter; an error on the error value. */
static void test_bound_counters(struct fid_cntr *const *ca, struct fid_cntr *const *cb)
{
	struct fid_cntr *send = ca[0], *write = ca[1], *read = ca[2], *recv = cb[0];
	uint64_t s0 = fi_cntr_read(send), r0 = fi_cntr_read(recv);
	char *rbuf = pages(4096), *sbuf = pages(4096);
	for (int i = 0; i < 3; i++)
		MUST(fi_recv(B.ep, rbuf + 64 * i, 64, NULL, FI_ADDR_UNSPEC, NULL));
	strcpy(sbuf, "hello");
	MUST(fi_send(A.ep, sbuf, 6, NULL, A.peer, NULL));
	MUST(fi_send(A.ep, sbuf, 6, NULL, A.peer, NULL));
	MUST(fi_inject(A.ep, sbuf, 6, A.peer));
	CHECK_EQ(fi_cntr_wait(send, s0 + 3, 5000), 0);
	CHECK_EQ(fi_cntr_wait(recv, r0 + 3, 5000), 0);
	CHECK_EQ(fi_cntr_read(send), s0 + 3);
	CHECK_EQ(fi_cntr_read(recv), r0 + 3);
	struct fi_cq_tagged_entry e;
	for (int i = 0; i < 2; i++)
		CHECK_EQ(one(A.cq, &e, 200000), 0);
	for (int i = 0; i < 3; i++)
		CHECK_EQ(one(B.cq, &e, 200000), 0);

	/* RMA: B's region counts remote writes (fi_mr_bind) on the device. */
	char *target = pages(4096);
	struct fid_mr *mr = reg(&B, target, 4096, FI_REMOTE_WRITE | FI_REMOTE_READ);
	struct fid_cntr *rw = cntr(&B);
	CHECK_EQ(fi_mr_bind(mr, &rw->fid, FI_REMOTE_WRITE), 0);
	CHECK_EQ(fi_mr_bind(mr, &rw->fid, FI_SEND), -FI_EINVAL);
	uint64_t w0 = fi_cntr_read(write), rd0 = fi_cntr_read(read);
	MUST(fi_write(A.ep, sbuf, 6, NULL, A.peer, (uint64_t)(uintptr_t)target, fi_mr_key(mr),
		      NULL));
	MUST(fi_inject_write(A.ep, sbuf, 3, A.peer, (uint64_t)(uintptr_t)target + 8,
			     fi_mr_key(mr)));
	MUST(fi_read(A.ep, rbuf + 1024, 6, NULL, A.peer, (uint64_t)(uintptr_t)target,
		     fi_mr_key(mr), NULL));
	CHECK_EQ(fi_cntr_wait(write, w0 + 2, 5000), 0);
	CHECK_EQ(fi_cntr_wait(read, rd0 + 1, 5000), 0);
	CHECK_EQ(fi_cntr_wait(rw, 2, 5000), 0);
	CHECK(memcmp(rbuf + 1024, "hello", 6) == 0);
	for (int i = 0; i < 2; i++)
		CHECK_EQ(one(A.cq, &e, 200000), 0);

	/* A key that is not ours: an error completion (FI_EACCES) and the error value. */
	uint64_t we0 = fi_cntr_readerr(write);
	MUST(fi_write(A.ep, sbuf, 6, NULL, A.peer, (uint64_t)(uintptr_t)target, 0x7777777,
		      NULL));
	struct fi_cq_err_entry err;
	CHECK_EQ(one_err(A.cq, &err), 0);
	CHECK_EQ(err.err, FI_EACCES);
	CHECK_EQ(fi_cntr_readerr(write), we0 + 1);

	/* A counter still bound cannot be closed; one in another domain cannot be bound. */
	CHECK_EQ(fi_close(&send->fid), -FI_EBUSY);
	CHECK_EQ(fi_close(&mr->fid), 0);
	CHECK_EQ(fi_close(&rw->fid), 0);
}

/* fi_mr_reg's access bits: a region without FI_REMOTE_WRITE refuses remote writes and
 * atomics, one without FI_REMOTE_READ remote reads. */
static void test_mr_access(void)
{
	char *target = pages(4096), *local = pages(4096);
	struct fid_mr *ro = reg(&B, target, 2048, FI_REMOTE_READ);
	struct fid_mr *wo = reg(&B, target + 2048, 2048, FI_REMOTE_WRITE);
	struct fi_cq_tagged_entry e;
	struct fi_cq_err_entry err;
	memcpy(target, "readable", 9);
	MUST(fi_write(A.ep, local, 8, NULL, A.peer, (uint64_t)(uintptr_t)target, fi_mr_key(ro),
		      NULL));
	CHECK_EQ(one_err(A.cq, &err), 0);
	CHECK_EQ(err.err, FI_EACCES);
	MUST(fi_read(A.ep, local, 9, NULL, A.peer, (uint64_t)(uintptr_t)target, fi_mr_key(ro),
		     NULL));
	CHECK_EQ(one(A.cq, &e, 200000), 0);
	CHECK(memcmp(local, "readable", 9) == 0);
	MUST(fi_read(A.ep, local, 8, NULL, A.peer, (uint64_t)(uintptr_t)target + 2048,
		     fi_mr_key(wo), NULL));
	CHECK_EQ(one_err(A.cq, &err), 0);
	CHECK_EQ(err.err, FI_EACCES);
	uint64_t one64 = 1, res = 0;
	MUST(fi_fetch_atomic(A.ep, &one64, 1, NULL, &res, NULL, A.peer,
			     (uint64_t)(uintptr_t)target, fi_mr_key(ro), FI_UINT64, FI_SUM, NULL));
	CHECK_EQ(one_err(A.cq, &err), 0);
	CHECK_EQ(err.err, FI_EACCES);
	MUST(fi_atomic(A.ep, &one64, 1, NULL, A.peer, (uint64_t)(uintptr_t)target + 2048,
		       fi_mr_key(wo), FI_UINT64, FI_SUM, NULL));
	CHECK_EQ(one(A.cq, &e, 200000), 0);
	CHECK_EQ(*(uint64_t *)(target + 2048), 1);
	struct fid_mr *bad;
	CHECK_EQ(fi_mr_reg(B.dom, target, 64, 1ULL << 60, 0, 0, 0, &bad, NULL), -FI_EINVAL);
	CHECK_EQ(fi_mr_reg(B.dom, target, 64, FI_REMOTE_READ, 8, 0, 0, &bad, NULL), -FI_EINVAL);
	fi_close(&ro->fid);
	fi_close(&wo->fid);
}

/* FI_TRIGGER: a send held until a counter's success value reaches the threshold; its data
 * read when it fires; threshold order, then submission order. */
static void test_fi_trigger(struct fid_cntr *send_cntr)
{
	struct fid_cntr *t = cntr(&A);
	char *rbuf = pages(4096), *sbuf = pages(4096);
	struct fi_triggered_context tc[4];
	struct iovec iov[4];
	struct fi_msg msg[4];
	struct fi_cq_tagged_entry e;
	uint64_t s0 = fi_cntr_read(send_cntr);
	for (int i = 0; i < 4; i++)
		MUST(fi_recv(B.ep, rbuf + 256 * i, 256, NULL, FI_ADDR_UNSPEC, NULL));
	/* Thresholds 3, 1, 2, 2 (posted in that order). */
	size_t th[4] = {3, 1, 2, 2};
	for (int i = 0; i < 4; i++) {
		tc[i].event_type = FI_TRIGGER_THRESHOLD;
		tc[i].trigger.threshold.cntr = t;
		tc[i].trigger.threshold.threshold = th[i];
		sprintf(sbuf + 64 * i, "old %d", i);
		iov[i].iov_base = sbuf + 64 * i;
		iov[i].iov_len = 16;
		msg[i] = (struct fi_msg){.msg_iov = &iov[i], .iov_count = 1, .addr = A.peer,
					 .context = &tc[i]};
		CHECK_EQ(fi_sendmsg(A.ep, &msg[i], FI_TRIGGER), 0);
	}
	/* Nothing goes before the counter moves (the connection is made meanwhile). */
	CHECK_EQ(one(B.cq, &e, 20000), -FI_EAGAIN);
	/* The data is read when the operation fires. */
	for (int i = 0; i < 4; i++)
		sprintf(sbuf + 64 * i, "new %d", i);
	CHECK_EQ(fi_cntr_add(t, 1), 0);
	CHECK_EQ(one(B.cq, &e, 200000), 0);
	CHECK(strcmp((char *)e.buf, "new 1") == 0);
	CHECK_EQ(one(B.cq, &e, 20000), -FI_EAGAIN);
	/* One add passing two thresholds: 2, 2 (submission order), then 3. */
	CHECK_EQ(fi_cntr_add(t, 2), 0);
	const char *want[3] = {"new 2", "new 3", "new 0"};
	for (int i = 0; i < 3; i++) {
		CHECK_EQ(one(B.cq, &e, 200000), 0);
		CHECK(e.buf && strcmp((char *)e.buf, want[i]) == 0);
	}
	/* The sender's completions carry the triggered contexts, and its send counter (the
	 * NIC counts it) moved by 4. */
	int seen = 0;
	for (int i = 0; i < 4; i++) {
		CHECK_EQ(one(A.cq, &e, 200000), 0);
		for (int j = 0; j < 4; j++)
			if (e.op_context == &tc[j])
				seen |= 1 << j;
		CHECK(e.flags & FI_SEND);
	}
	CHECK_EQ(seen, 15);
	CHECK_EQ(fi_cntr_wait(send_cntr, s0 + 4, 5000), 0);

	/* A threshold already reached fires at once. */
	MUST(fi_recv(B.ep, rbuf, 256, NULL, FI_ADDR_UNSPEC, NULL));
	tc[0].trigger.threshold.threshold = 2;
	CHECK_EQ(fi_sendmsg(A.ep, &msg[0], FI_TRIGGER), 0);
	CHECK_EQ(one(B.cq, &e, 200000), 0);
	CHECK_EQ(one(A.cq, &e, 200000), 0);

	/* Bad triggers: a closed counter, another event type, no context; receives cannot be
	 * triggered. */
	struct fid_cntr *gone = cntr(&A);
	fi_close(&gone->fid);
	tc[1].trigger.threshold.cntr = gone;
	CHECK_EQ(fi_sendmsg(A.ep, &msg[1], FI_TRIGGER), -FI_EINVAL);
	tc[1].trigger.threshold.cntr = t;
	tc[1].event_type = FI_TRIGGER_XPU;
	CHECK_EQ(fi_sendmsg(A.ep, &msg[1], FI_TRIGGER), -FI_ENOSYS);
	tc[1].event_type = FI_TRIGGER_THRESHOLD;
	msg[1].context = NULL;
	CHECK_EQ(fi_sendmsg(A.ep, &msg[1], FI_TRIGGER), -FI_EINVAL);
	msg[1].context = &tc[1];
	CHECK_EQ(fi_recvmsg(B.ep, &msg[1], FI_TRIGGER), -FI_ENOSYS);
	/* A counter of the other domain cannot trigger this endpoint's work. */
	struct fid_cntr *other = cntr(&B);
	tc[1].trigger.threshold.cntr = other;
	CHECK_EQ(fi_sendmsg(A.ep, &msg[1], FI_TRIGGER), -FI_EINVAL);
	fi_close(&other->fid);
	fi_close(&t->fid);
}

/* fi_ep_alias (fi_endpoint(3)): another fid_ep for the same endpoint with default flags of
 * its own. An alias made with FI_TRANSMIT | FI_TRIGGER posts fi_write / fi_send /
 * fi_atomic as triggered operations (their contexts are triggered contexts), as
 * fabtests' fi_rdm_rma_trigger does; the endpoint posts as before. */
static void test_alias(void)
{
	struct fid_ep *al = NULL, *rx_al = NULL;
	struct fid_cntr *t = cntr(&A);
	char *target = pages(4096), *sbuf = pages(4096), *rbuf = pages(4096);
	struct fid_mr *mr = reg(&B, target, 4096, FI_REMOTE_WRITE);
	struct fi_cq_tagged_entry e;
	uint64_t f;

	/* Exactly one of FI_TRANSMIT and FI_RECV. */
	CHECK_EQ(fi_ep_alias(A.ep, &al, FI_TRIGGER), -FI_EINVAL);
	CHECK_EQ(fi_ep_alias(A.ep, &al, FI_TRANSMIT | FI_RECV | FI_TRIGGER), -FI_EINVAL);
	CHECK_EQ(fi_ep_alias(A.ep, &al, FI_TRANSMIT | FI_TRIGGER), 0);
	REQUIRE(al != NULL && al != A.ep);

	/* Its transmit flags are the request's; the endpoint's are unchanged. */
	f = FI_TRANSMIT;
	CHECK_EQ(fi_control(&al->fid, FI_GETOPSFLAG, &f), 0);
	CHECK(f & FI_TRIGGER);
	f = FI_TRANSMIT;
	CHECK_EQ(fi_control(&A.ep->fid, FI_GETOPSFLAG, &f), 0);
	CHECK(!(f & FI_TRIGGER));
	/* It names the endpoint's address. */
	char name[64];
	size_t len = sizeof(name);
	CHECK_EQ(fi_getname(&al->fid, name, &len), 0);
	CHECK(len == A.namelen && memcmp(name, A.name, len) == 0);

	/* A write through the alias waits for its counter; one through the endpoint does
	 * not. */
	struct fi_triggered_context tw = {.event_type = FI_TRIGGER_THRESHOLD};
	tw.trigger.threshold.cntr = t;
	tw.trigger.threshold.threshold = fi_cntr_read(t) + 1;
	strcpy(sbuf, "triggered");
	strcpy(sbuf + 64, "plain");
	CHECK_EQ(fi_write(al, sbuf, 10, NULL, A.peer, (uint64_t)(uintptr_t)target,
			  fi_mr_key(mr), &tw), 0);
	CHECK_EQ(fi_write(A.ep, sbuf + 64, 6, NULL, A.peer, (uint64_t)(uintptr_t)target + 64,
			  fi_mr_key(mr), sbuf), 0);
	CHECK_EQ(one(A.cq, &e, 200000), 0);
	CHECK(e.op_context == sbuf);
	CHECK(strcmp(target + 64, "plain") == 0);
	spin(20000);
	CHECK(target[0] == 0);
	CHECK_EQ(one(A.cq, &e, 2000), -FI_EAGAIN);
	CHECK_EQ(fi_cntr_add(t, 1), 0);
	CHECK_EQ(one(A.cq, &e, 200000), 0);
	CHECK(e.op_context == &tw);
	CHECK(e.flags & FI_WRITE);
	CHECK(strcmp(target, "triggered") == 0);

	/* A send through the alias as well. */
	struct fi_triggered_context ts = tw;
	ts.trigger.threshold.threshold = fi_cntr_read(t) + 1;
	MUST(fi_recv(B.ep, rbuf, 64, NULL, FI_ADDR_UNSPEC, rbuf));
	strcpy(sbuf + 128, "sent later");
	CHECK_EQ(fi_send(al, sbuf + 128, 11, NULL, A.peer, &ts), 0);
	CHECK_EQ(one(B.cq, &e, 20000), -FI_EAGAIN);
	CHECK_EQ(fi_cntr_add(t, 1), 0);
	CHECK_EQ(one(B.cq, &e, 200000), 0);
	CHECK(strcmp(rbuf, "sent later") == 0);
	CHECK_EQ(one(A.cq, &e, 200000), 0);
	CHECK(e.op_context == &ts);
	/* With FI_TRIGGER in its defaults, a context that is no triggered context is refused
	 * as fi_sendmsg refuses it. */
	CHECK_EQ(fi_send(al, sbuf, 4, NULL, A.peer, NULL), -FI_EINVAL);

	/* The alias's flags change on their own (FI_SETOPSFLAG); then it posts at once. */
	f = FI_TRANSMIT;
	CHECK_EQ(fi_control(&al->fid, FI_SETOPSFLAG, &f), 0);
	MUST(fi_recv(B.ep, rbuf, 64, NULL, FI_ADDR_UNSPEC, rbuf));
	CHECK_EQ(fi_send(al, sbuf + 64, 6, NULL, A.peer, sbuf), 0);
	CHECK_EQ(one(B.cq, &e, 200000), 0);
	CHECK(strcmp(rbuf, "plain") == 0);
	CHECK_EQ(one(A.cq, &e, 200000), 0);
	CHECK(e.op_context == sbuf);

	/* A receive-side alias posts receives of the endpoint. */
	CHECK_EQ(fi_ep_alias(B.ep, &rx_al, FI_RECV | FI_COMPLETION), 0);
	MUST(fi_recv(rx_al, rbuf + 256, 64, NULL, FI_ADDR_UNSPEC, rbuf + 256));
	MUST(fi_send(A.ep, "via alias", 10, NULL, A.peer, NULL));
	CHECK_EQ(one(B.cq, &e, 200000), 0);
	CHECK(e.op_context == rbuf + 256);
	CHECK(strcmp(rbuf + 256, "via alias") == 0);
	CHECK_EQ(one(A.cq, &e, 200000), 0);

	/* An endpoint is released only once its aliases are closed; an alias binds
	 * nothing. */
	CHECK_EQ(fi_close(&A.ep->fid), -FI_EBUSY);
	CHECK(fi_ep_bind(al, &A.cq->fid, FI_TRANSMIT) < 0);
	CHECK_EQ(fi_close(&al->fid), 0);
	CHECK_EQ(fi_close(&rx_al->fid), 0);
	/* A missing request is refused. */
	CHECK_EQ(fi_control(&A.ep->fid, FI_ALIAS, NULL), -FI_EINVAL);
	CHECK_EQ(fi_close(&mr->fid), 0);
	fi_close(&t->fid);
}

/* Poll sets (fi_poll(3)): CQs and counters of one domain; fi_poll gives the contexts of
 * those with events, in the order they were added: a CQ that holds an entry, a counter
 * whose value changed since the poll set last reported it. */
static void test_poll(struct fi_info *info)
{
	int cq_tag, cntr_tag;
	struct fid_domain *d;
	struct fid_cq *cq;
	struct fid_av *av;
	struct fid_ep *ep;
	struct fid_cntr *sent;
	struct fid_poll *ps;
	struct fi_cq_attr cq_attr = {.format = FI_CQ_FORMAT_TAGGED, .size = 64};
	struct fi_av_attr av_attr = {.type = FI_AV_TABLE};
	struct fi_cntr_attr ca = {.events = FI_CNTR_EVENTS_COMP, .wait_obj = FI_WAIT_UNSPEC};
	struct fi_poll_attr pa = {.flags = 0};
	MUST(fi_domain(fabric, info, &d, NULL));
	MUST(fi_cq_open(d, &cq_attr, &cq, &cq_tag));
	MUST(fi_av_open(d, &av_attr, &av, NULL));
	MUST(fi_cntr_open(d, &ca, &sent, &cntr_tag));
	MUST(fi_endpoint(d, info, &ep, NULL));
	MUST(fi_ep_bind(ep, &av->fid, 0));
	MUST(fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV));
	MUST(fi_ep_bind(ep, &sent->fid, FI_SEND));
	MUST(fi_enable(ep));
	fi_addr_t to_b;
	MUST(fi_av_insert(av, B.name, 1, &to_b, 0, NULL));

	pa.flags = 1;
	CHECK_EQ(fi_poll_open(d, &pa, &ps), -FI_EINVAL);
	pa.flags = 0;
	MUST(fi_poll_open(d, &pa, &ps));
	/* Only CQs and counters of the poll set's domain, each once. */
	CHECK_EQ(fi_poll_add(ps, &B.cq->fid, 0), -FI_EINVAL);
	CHECK_EQ(fi_poll_add(ps, &ep->fid, 0), -FI_EINVAL);
	CHECK_EQ(fi_poll_add(ps, &cq->fid, 0), 0);
	CHECK_EQ(fi_poll_add(ps, &sent->fid, 0), 0);
	CHECK_EQ(fi_poll_add(ps, &cq->fid, 0), -FI_EINVAL);

	void *ctx[4] = {0};
	CHECK_EQ(fi_poll(ps, ctx, 4), 0);
	CHECK_EQ(fi_poll(ps, NULL, 4), -FI_EINVAL);

	/* A send: its completion and its counter. */
	char *rbuf = pages(4096), *sbuf = pages(4096);
	strcpy(sbuf, "polled");
	MUST(fi_recv(B.ep, rbuf, 64, NULL, FI_ADDR_UNSPEC, NULL));
	MUST(fi_send(ep, sbuf, 7, NULL, to_b, sbuf));
	struct fi_cq_tagged_entry e;
	CHECK_EQ(one(B.cq, &e, 200000), 0);
	CHECK_EQ(fi_cntr_wait(sent, 1, 5000), 0);
	int n = 0;
	for (int i = 0; i < 200000 && n < 2; i++)
		n = fi_poll(ps, ctx, 4);
	CHECK_EQ(n, 2);
	CHECK(ctx[0] == &cq_tag && ctx[1] == &cntr_tag);
	/* The counter was reported; the CQ still holds its entry. */
	CHECK_EQ(fi_poll(ps, ctx, 4), 1);
	CHECK(ctx[0] == &cq_tag);
	CHECK_EQ(fi_cq_read(cq, &e, 1), 1);
	CHECK(e.op_context == sbuf);
	CHECK_EQ(fi_poll(ps, ctx, 4), 0);
	/* A counter change not reported for want of room is reported next time. */
	CHECK_EQ(fi_cntr_add(sent, 1), 0);
	MUST(fi_recv(B.ep, rbuf, 64, NULL, FI_ADDR_UNSPEC, NULL));
	MUST(fi_send(ep, sbuf, 7, NULL, to_b, sbuf));
	CHECK_EQ(one(B.cq, &e, 200000), 0);
	CHECK_EQ(fi_cntr_wait(sent, 3, 5000), 0);
	n = 0;
	for (int i = 0; i < 200000 && n == 0; i++)
		n = fi_poll(ps, ctx, 1);
	CHECK_EQ(n, 1);
	CHECK(ctx[0] == &cq_tag);
	CHECK_EQ(fi_cq_read(cq, &e, 1), 1);
	CHECK_EQ(fi_poll(ps, ctx, 1), 1);
	CHECK(ctx[0] == &cntr_tag);
	CHECK_EQ(fi_poll(ps, ctx, 4), 0);

	/* Members cannot close, nor the poll set while it has them. */
	CHECK_EQ(fi_close(&ps->fid), -FI_EBUSY);
	CHECK_EQ(fi_close(&sent->fid), -FI_EBUSY);
	CHECK_EQ(fi_poll_del(ps, &cq->fid, 0), 0);
	CHECK_EQ(fi_poll_del(ps, &cq->fid, 0), -FI_EINVAL);
	CHECK_EQ(fi_poll_del(ps, &sent->fid, 0), 0);
	CHECK_EQ(fi_close(&ps->fid), 0);
	CHECK_EQ(fi_close(&ep->fid), 0);
	CHECK_EQ(fi_close(&sent->fid), 0);
	CHECK_EQ(fi_close(&cq->fid), 0);
	CHECK_EQ(fi_close(&av->fid), 0);
	CHECK_EQ(fi_close(&d->fid), 0);
}

/* The deferred work queue: RMA, atomics, tagged sends and counter operations queued to
 * the domain, with fi_trigger(3)'s completion rules; cancel and flush; bad requests. */
static void test_deferred_work(void)
{
	struct fid_cntr *t = cntr(&A), *comp = cntr(&A), *d = cntr(&A);
	char *target = pages(8192), *src = pages(4096);
	struct fid_mr *mr = reg(&B, target, 8192, FI_REMOTE_WRITE | FI_REMOTE_READ);
	uint64_t key = fi_mr_key(mr), base = (uint64_t)(uintptr_t)target;
	struct fi_cq_tagged_entry e;
	struct iovec iov = {.iov_base = src, .iov_len = 32};
	struct fi_rma_iov riov = {.addr = base, .len = 32, .key = key};
	struct fi_op_rma rma = {.ep = A.ep,
				.msg = {.msg_iov = &iov, .iov_count = 1, .addr = A.peer,
					.rma_iov = &riov, .rma_iov_count = 1, .context = src}};
	struct fi_deferred_work w = {.threshold = 2, .triggering_cntr = t,
				     .completion_cntr = comp, .op_type = FI_OP_WRITE};
	w.op.rma = &rma;
	strcpy(src, "deferred write");
	CHECK_EQ(fi_control(&A.dom->fid, FI_QUEUE_WORK, &w), 0);
	spin(2000);
	CHECK_EQ(fi_cntr_read(comp), 0);
	CHECK(target[0] == 0);
	CHECK_EQ(fi_cntr_add(t, 1), 0);
	CHECK_EQ(fi_cntr_adderr(t, 1), 0); /* success + error reaches 2 */
	CHECK_EQ(fi_cntr_wait(comp, 1, 5000), 0);
	CHECK(strcmp(target, "deferred write") == 0);
	/* No endpoint completion without FI_COMPLETION. */
	CHECK_EQ(one(A.cq, &e, 5000), -FI_EAGAIN);
	/* With FI_COMPLETION: an entry with the message's context. */
	rma.flags = FI_COMPLETION;
	riov.addr = base + 64;
	w.threshold = 3;
	CHECK_EQ(fi_control(&A.dom->fid, FI_QUEUE_WORK, &w), 0);
	CHECK_EQ(fi_cntr_add(t, 1), 0);
	CHECK_EQ(one(A.cq, &e, 200000), 0);
	CHECK(e.op_context == src);
	CHECK(e.flags & FI_WRITE);
	CHECK_EQ(fi_cntr_read(comp), 2);
	CHECK(strcmp(target + 64, "deferred write") == 0);

	/* Counter operations: add and set, in threshold order; never the completion counter. */
	struct fi_op_cntr add = {.cntr = d, .value = 5}, set = {.cntr = d, .value = 100};
	struct fi_deferred_work wa = {.threshold = 4, .triggering_cntr = t,
				      .op_type = FI_OP_CNTR_ADD};
	struct fi_deferred_work ws = {.threshold = 5, .triggering_cntr = t,
				      .op_type = FI_OP_CNTR_SET};
	wa.op.cntr = &add;
	ws.op.cntr = &set;
	CHECK_EQ(fi_control(&A.dom->fid, FI_QUEUE_WORK, &ws), 0);
	CHECK_EQ(fi_control(&A.dom->fid, FI_QUEUE_WORK, &wa), 0);
	CHECK_EQ(fi_cntr_add(t, 1), 0); /* 4: add */
	CHECK_EQ(fi_cntr_read(d), 5);
	CHECK_EQ(fi_cntr_add(t, 1), 0); /* 5: set */
	CHECK_EQ(fi_cntr_read(d), 100);
	struct fi_deferred_work wbad = wa;
	wbad.completion_cntr = comp;
	CHECK_EQ(fi_control(&A.dom->fid, FI_QUEUE_WORK, &wbad), -FI_EINVAL);

	/* Atomics: fetch-add and compare-and-swap, the operand read when they fire. */
	uint64_t *word = (uint64_t *)(target + 4096);
	uint64_t *operand = (uint64_t *)(src + 1024), *result = (uint64_t *)(src + 2048);
	uint64_t *cmpv = (uint64_t *)(src + 3072);
	*word = 40;
	*operand = 1;
	struct fi_ioc oioc = {.addr = operand, .count = 1}, rioc = {.addr = result, .count = 1};
	struct fi_ioc cioc = {.addr = cmpv, .count = 1};
	struct fi_rma_ioc aioc = {.addr = base + 4096, .count = 1, .key = key};
	struct fi_op_fetch_atomic fa = {
		.ep = A.ep,
		.msg = {.msg_iov = &oioc, .iov_count = 1, .addr = A.peer, .rma_iov = &aioc,
			.rma_iov_count = 1, .datatype = FI_UINT64, .op = FI_SUM},
		.fetch = {.msg_iov = &rioc, .iov_count = 1}};
	struct fi_deferred_work wf = {.threshold = 6, .triggering_cntr = t,
				      .completion_cntr = comp, .op_type = FI_OP_FETCH_ATOMIC};
	wf.op.fetch_atomic = &fa;
	CHECK_EQ(fi_control(&A.dom->fid, FI_QUEUE_WORK, &wf), 0);
	*operand = 2; /* read when it fires */
	CHECK_EQ(fi_cntr_add(t, 1), 0);
	CHECK_EQ(fi_cntr_wait(comp, 3, 5000), 0);
	CHECK_EQ(*result, 40);
	CHECK_EQ(*word, 42);
	*cmpv = 42;
	*operand = 7;
	struct fi_op_compare_atomic ca = {
		.ep = A.ep,
		.msg = {.msg_iov = &oioc, .iov_count = 1, .addr = A.peer, .rma_iov = &aioc,
			.rma_iov_count = 1, .datatype = FI_UINT64, .op = FI_CSWAP},
		.fetch = {.msg_iov = &rioc, .iov_count = 1},
		.compare = {.msg_iov = &cioc, .iov_count = 1}};
	struct fi_deferred_work wc = {.threshold = 7, .triggering_cntr = t,
				      .completion_cntr = comp, .op_type = FI_OP_COMPARE_ATOMIC};
	wc.op.compare_atomic = &ca;
	CHECK_EQ(fi_control(&A.dom->fid, FI_QUEUE_WORK, &wc), 0);
	CHECK_EQ(fi_cntr_add(t, 1), 0);
	CHECK_EQ(fi_cntr_wait(comp, 4, 5000), 0);
	CHECK_EQ(*result, 42);
	CHECK_EQ(*word, 7);

	/* A tagged send (eager), and one too large to be triggered. */
	char *tbuf = pages(4096);
	MUST(fi_trecv(B.ep, tbuf, 256, NULL, FI_ADDR_UNSPEC, 0x77, 0, NULL));
	struct iovec tiov = {.iov_base = src, .iov_len = 20};
	struct fi_op_tagged tg = {.ep = A.ep,
				  .msg = {.msg_iov = &tiov, .iov_count = 1, .addr = A.peer,
					  .tag = 0x77}};
	struct fi_deferred_work wt = {.threshold = 8, .triggering_cntr = t,
				      .completion_cntr = comp, .op_type = FI_OP_TSEND};
	wt.op.tagged = &tg;
	strcpy(src, "tagged deferred");
	CHECK_EQ(fi_control(&A.dom->fid, FI_QUEUE_WORK, &wt), 0);
	CHECK_EQ(fi_cntr_add(t, 1), 0);
	CHECK_EQ(one(B.cq, &e, 200000), 0);
	CHECK_EQ(e.tag, 0x77);
	CHECK(strcmp(tbuf, "tagged deferred") == 0);
	CHECK_EQ(fi_cntr_wait(comp, 5, 5000), 0);
	tiov.iov_len = 1000;
	CHECK_EQ(fi_control(&A.dom->fid, FI_QUEUE_WORK, &wt), -FI_ENOSYS);

	/* Receives cannot be deferred. */
	struct fi_op_msg rm = {.ep = B.ep, .msg = {.msg_iov = &iov, .iov_count = 1}};
	struct fi_deferred_work wr = {.threshold = 1, .triggering_cntr = t, .op_type = FI_OP_RECV};
	wr.op.msg = &rm;
	CHECK_EQ(fi_control(&A.dom->fid, FI_QUEUE_WORK, &wr), -FI_ENOSYS);

	/* Cancel: taken back before it fires, never runs; a second cancel, and a cancel of
	 * work never queued, are -FI_ENOENT. */
	uint64_t c0 = fi_cntr_read(comp);
	riov.addr = base + 128;
	rma.flags = 0;
	w.threshold = 100;
	CHECK_EQ(fi_control(&A.dom->fid, FI_QUEUE_WORK, &w), 0);
	CHECK_EQ(fi_control(&A.dom->fid, FI_CANCEL_WORK, &w), 0);
	CHECK_EQ(fi_control(&A.dom->fid, FI_CANCEL_WORK, &w), -FI_ENOENT);
	struct fi_deferred_work never = w;
	CHECK_EQ(fi_control(&A.dom->fid, FI_CANCEL_WORK, &never), -FI_ENOENT);
	/* Work that fired cannot be cancelled. */
	CHECK_EQ(fi_control(&A.dom->fid, FI_CANCEL_WORK, &wf), -FI_ENOENT);

	/* Flush by triggering counter, then everything. */
	struct fid_cntr *t2 = cntr(&A);
	struct fi_deferred_work w1 = w, w2 = w;
	struct fi_op_rma rma2 = rma;
	struct fi_rma_iov riov2 = riov;
	riov2.addr = base + 192;
	rma2.msg.rma_iov = &riov2;
	w2.op.rma = &rma2;
	w1.threshold = level(t) + 1;
	w2.triggering_cntr = t2;
	w2.threshold = 1;
	CHECK_EQ(fi_control(&A.dom->fid, FI_QUEUE_WORK, &w1), 0);
	CHECK_EQ(fi_control(&A.dom->fid, FI_QUEUE_WORK, &w2), 0);
	struct fi_deferred_work which = {.triggering_cntr = t};
	CHECK_EQ(fi_control(&A.dom->fid, FI_FLUSH_WORK, &which), 0);
	CHECK_EQ(fi_cntr_add(t, 200), 0);
	CHECK_EQ(fi_cntr_add(t2, 1), 0); /* w2 survived the flush of t's work */
	CHECK_EQ(fi_cntr_wait(comp, c0 + 1, 5000), 0);
	spin(5000);
	CHECK_EQ(fi_cntr_read(comp), c0 + 1);
	CHECK(target[128] == 0);
	CHECK(strcmp(target + 192, "tagged deferred") == 0);
	w1.threshold = level(t) + 1;
	w2.threshold = fi_cntr_read(t2) + 1;
	CHECK_EQ(fi_control(&A.dom->fid, FI_QUEUE_WORK, &w1), 0);
	CHECK_EQ(fi_control(&A.dom->fid, FI_QUEUE_WORK, &w2), 0);
	CHECK_EQ(fi_control(&A.dom->fid, FI_FLUSH_WORK, NULL), 0);
	CHECK_EQ(fi_cntr_add(t, 1), 0);
	CHECK_EQ(fi_cntr_add(t2, 1), 0);
	spin(5000);
	CHECK_EQ(fi_cntr_read(comp), c0 + 1);
	CHECK_EQ(fi_control(&A.dom->fid, FI_CANCEL_WORK, &w1), -FI_ENOENT);

	/* A key that is not ours: the completion counter's error value, nothing else. */
	uint64_t ce0 = fi_cntr_readerr(comp);
	riov.key = 0x5555555;
	w.threshold = level(t) + 1;
	CHECK_EQ(fi_control(&A.dom->fid, FI_QUEUE_WORK, &w), 0);
	CHECK_EQ(fi_cntr_add(t, 1), 0);
	spin(20000);
	CHECK_EQ(fi_cntr_readerr(comp), ce0 + 1);
	CHECK_EQ(one(A.cq, &e, 5000), -FI_EAGAIN);
	riov.key = key;

	/* Bad requests: a closed triggering counter, an AV index out of range, an endpoint of
	 * another domain, an unknown operation, no request. */
	struct fid_cntr *gone = cntr(&A);
	fi_close(&gone->fid);
	struct fi_deferred_work wg = w;
	wg.triggering_cntr = gone;
	CHECK_EQ(fi_control(&A.dom->fid, FI_QUEUE_WORK, &wg), -FI_EINVAL);
	struct fi_op_rma far = rma;
	far.msg.addr = 999;
	wg = w;
	wg.op.rma = &far;
	CHECK_EQ(fi_control(&A.dom->fid, FI_QUEUE_WORK, &wg), -FI_EINVAL);
	struct fi_op_rma foreign = rma;
	foreign.ep = B.ep;
	wg.op.rma = &foreign;
	CHECK_EQ(fi_control(&A.dom->fid, FI_QUEUE_WORK, &wg), -FI_EINVAL);
	wg = w;
	wg.op_type = (enum fi_op_type)99;
	CHECK_EQ(fi_control(&A.dom->fid, FI_QUEUE_WORK, &wg), -FI_EINVAL);
	CHECK_EQ(fi_control(&A.dom->fid, FI_QUEUE_WORK, NULL), -FI_EINVAL);
	CHECK_EQ(fi_control(&A.dom->fid, FI_CANCEL_WORK, NULL), -FI_EINVAL);

	/* Table exhaustion: -FI_ENOSPC once the NIC's table (2048 entries) is full; nothing
	 * queued fires twice, and a flush empties it. */
	static struct fi_deferred_work many[2100];
	static struct fi_op_cntr inc;
	inc = (struct fi_op_cntr){.cntr = d, .value = 1};
	int queued = 0, r = 0;
	for (int i = 0; i < 2100; i++) {
		many[i] = (struct fi_deferred_work){.threshold = 1ULL << 50, .triggering_cntr = t,
						    .op_type = FI_OP_CNTR_ADD};
		many[i].op.cntr = &inc;
		r = fi_control(&A.dom->fid, FI_QUEUE_WORK, &many[i]);
		if (r)
			break;
		queued++;
	}
	CHECK_EQ(r, -FI_ENOSPC);
	CHECK(queued > 1000 && queued <= 2048);
	CHECK_EQ(fi_control(&A.dom->fid, FI_FLUSH_WORK, NULL), 0);
	CHECK_EQ(fi_control(&A.dom->fid, FI_QUEUE_WORK, &many[0]), 0);
	CHECK_EQ(fi_control(&A.dom->fid, FI_CANCEL_WORK, &many[0]), 0);
	uint64_t d0 = fi_cntr_read(d);
	CHECK_EQ(fi_cntr_set(t, 1ULL << 51), 0);
	CHECK_EQ(fi_cntr_read(d), d0);

	fi_close(&mr->fid);
	fi_close(&t2->fid);
}

/* Peeks at B with `flags` until a message is found (the FI_ENOMSG entries of the misses
 * read and dropped): 0 and its completion, or -1 after 1000 tries. */
static int peek_until(struct fi_msg_tagged *m, uint64_t flags, struct fi_cq_tagged_entry *e)
{
	for (int tries = 0; tries < 1000; tries++) {
		if (fi_trecvmsg(B.ep, m, flags) != 0)
			return -1;
		if (one(B.cq, e, 200000) == 0)
			return 0;
		struct fi_cq_err_entry x;
		fi_cq_readerr(B.cq, &x, 0);
	}
	return -1;
}

/* FI_PEEK, FI_CLAIM and FI_DISCARD (fi_tagged(3)) on eager and rendezvous messages. */
static void test_peek(void)
{
	char *sbuf = pages(1 << 16), *rbuf = pages(1 << 16);
	struct fi_cq_tagged_entry e;
	struct fi_cq_err_entry err;
	struct fi_context pctx, cctx;
	struct iovec iov = {.iov_base = rbuf, .iov_len = 1 << 16};
	struct fi_msg_tagged m = {.msg_iov = &iov, .iov_count = 1, .addr = FI_ADDR_UNSPEC,
				  .tag = 0x500, .context = &pctx};
	/* Nothing there yet: an FI_ENOMSG error entry. */
	CHECK_EQ(fi_trecvmsg(B.ep, &m, FI_PEEK), 0);
	CHECK_EQ(one_err(B.cq, &err), 0);
	CHECK_EQ(err.err, FI_ENOMSG);
	CHECK(err.op_context == &pctx);
	/* An eager and a rendezvous message, unexpected at B. */
	memset(sbuf, 'e', 100);
	memset(sbuf + 1000, 'r', 40000);
	MUST(fi_tsenddata(A.ep, sbuf, 100, NULL, 77, A.peer, 0x500, NULL));
	MUST(fi_tsend(A.ep, sbuf + 1000, 40000, NULL, A.peer, 0x501, NULL));
	/* Peek until each has arrived: its tag, length, CQ data; nothing is consumed. */
	CHECK_EQ(peek_until(&m, FI_PEEK, &e), 0);
	CHECK_EQ(e.len, 100);
	CHECK_EQ(e.tag, 0x500);
	CHECK_EQ(e.data, 77);
	CHECK(e.flags & FI_REMOTE_CQ_DATA);
	CHECK(e.buf == NULL);
	CHECK_EQ(fi_trecvmsg(B.ep, &m, FI_PEEK), 0);
	CHECK_EQ(one(B.cq, &e, 200000), 0);
	/* Claim the eager one, then receive it with the same context. */
	CHECK_EQ(fi_trecvmsg(B.ep, &m, FI_PEEK | FI_CLAIM), 0);
	CHECK_EQ(one(B.cq, &e, 200000), 0);
	CHECK_EQ(fi_trecvmsg(B.ep, &m, FI_PEEK), 0); /* claimed: no longer there */
	CHECK_EQ(one_err(B.cq, &err), 0);
	CHECK_EQ(err.err, FI_ENOMSG);
	memset(rbuf, 0, 200);
	CHECK_EQ(fi_trecvmsg(B.ep, &m, FI_CLAIM), 0);
	CHECK_EQ(one(B.cq, &e, 200000), 0);
	CHECK_EQ(e.len, 100);
	CHECK(e.op_context == &pctx);
	CHECK(rbuf[0] == 'e' && rbuf[99] == 'e');
	CHECK_EQ(one(A.cq, &e, 200000), 0); /* the eager send's completion */
	/* A claim of a context that claimed nothing. */
	m.context = &cctx;
	CHECK_EQ(fi_trecvmsg(B.ep, &m, FI_CLAIM), -FI_EINVAL);
	/* Discard the rendezvous one: its sender completes, no receive takes it. */
	m.tag = 0x501;
	CHECK_EQ(peek_until(&m, FI_PEEK | FI_DISCARD, &e), 0);
	CHECK_EQ(e.len, 40000);
	CHECK_EQ(one(A.cq, &e, 200000), 0);
	CHECK(e.flags & FI_SEND);
	CHECK_EQ(fi_trecvmsg(B.ep, &m, FI_PEEK), 0);
	CHECK_EQ(one_err(B.cq, &err), 0);
	CHECK_EQ(err.err, FI_ENOMSG);
	/* FI_DISCARD alone means nothing. */
	CHECK_EQ(fi_trecvmsg(B.ep, &m, FI_DISCARD), -FI_EINVAL);
}

/* Tagged receives with a bad buffer. */
static void test_bad_trecv(void)
{
	CHECK_EQ(fi_trecv(B.ep, NULL, 64, NULL, FI_ADDR_UNSPEC, 1, 0, NULL), -FI_EINVAL);
	char *buf = pages(4096);
	CHECK_EQ(fi_trecv(B.ep, buf, 64, (void *)0x1234, FI_ADDR_UNSPEC, 1, 0, NULL), -FI_EINVAL);
}

/* An endpoint that is not enabled takes no triggered work. */
static void test_not_enabled(struct fi_info *info)
{
	struct fid_ep *ep;
	MUST(fi_endpoint(A.dom, info, &ep, NULL));
	struct fid_cntr *t = cntr(&A);
	char buf[8] = {0};
	struct iovec iov = {.iov_base = buf, .iov_len = 8};
	struct fi_op_msg m = {.ep = ep, .msg = {.msg_iov = &iov, .iov_count = 1}};
	struct fi_deferred_work w = {.threshold = 1, .triggering_cntr = t, .op_type = FI_OP_SEND};
	w.op.msg = &m;
	CHECK_EQ(fi_control(&A.dom->fid, FI_QUEUE_WORK, &w), -FI_EOPBADSTATE);
	fi_close(&ep->fid);
	fi_close(&t->fid);
}

int main(void)
{
	struct fi_info *hints = fi_allocinfo(), *list;
	hints->caps = FI_MSG | FI_TAGGED | FI_RMA | FI_ATOMIC | FI_TRIGGER | FI_RMA_EVENT;
	hints->ep_attr->type = FI_EP_RDM;
	hints->domain_attr->mr_mode = FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
	hints->fabric_attr->prov_name = strdup("ringbell");
	MUST(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, hints, &list));
	if (!list->next) {
		fprintf(stderr, "two NICs are needed (RINGBELL_NICS=2)\n");
		return 2;
	}
	MUST(fi_fabric(list->fabric_attr, &fabric, NULL));
	struct fid_cntr *ca[3], *cb[1];
	const uint64_t fa[3] = {FI_SEND, FI_WRITE, FI_READ}, fb[1] = {FI_RECV};
	open_side(list, &A, ca, fa, 3);
	open_side(list->next, &B, cb, fb, 1);
	MUST(fi_av_insert(A.av, B.name, 1, &A.peer, 0, NULL));
	MUST(fi_av_insert(B.av, A.name, 1, &B.peer, 0, NULL));

	test_counter_calls();
	test_bound_counters(ca, cb);
	test_mr_access();
	test_fi_trigger(ca[0]);
	test_alias();
	test_poll(list);
	test_deferred_work();
	test_not_enabled(list);
	test_bad_trecv();
	test_peek();

	fi_freeinfo(hints);
	fi_freeinfo(list);
	ct_name = "trigger";
	return ct_summary_exit();
}
