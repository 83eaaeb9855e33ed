/* msgep.c: connected endpoints (FI_EP_MSG, fi_cm(3), fi_eq(3)) in one process: a passive
 * endpoint on rb0 listening, endpoints on rb1 connecting to it with private data, the
 * request reported on the event queue (FI_CONNREQ with an info whose handle names it),
 * accepted with private data of its own (FI_CONNECTED on both sides, the active side with
 * that data) or rejected (FI_ECONNREFUSED in an error entry), messages and RMA over the
 * connection, a connection to a number nobody listens on, fi_shutdown (FI_SHUTDOWN on the
 * other side), FI_OPT_CM_DATA_SIZE, the remote accesses an endpoint's counters count
 * (FI_RMA_EVENT), and bad input.
 */
#include "ctest.h"

static struct fi_info *list; /* rb0 then rb1, FI_EP_MSG */
static struct fid_fabric *fab;
static struct fid_domain *da, *db;
static struct fid_eq *eqa, *eqb;
static struct fid_cq *cqa, *cqb;
static struct fid_pep *pep;
static char pepname[64];
static char *abuf, *bbuf;
static struct fid_mr *amr, *bmr;
/* A's endpoints count the remote writes and reads they are the target of (FI_RMA_EVENT). */
static struct fid_cntr *rwrite, *rread;
#define BUFLEN 65536

struct cm_entry {
	struct fi_eq_cm_entry e;
	char data[64];
};

static struct fid_eq *eq_open(void)
{
	struct fi_eq_attr attr = {.size = 16, .wait_obj = FI_WAIT_UNSPEC};
	struct fid_eq *eq = NULL;
	REQUIRE(fi_eq_open(fab, &attr, &eq, NULL) == 0);
	return eq;
}

static struct fid_cq *cq_open(struct fid_domain *d)
{
	struct fi_cq_attr attr = {.format = FI_CQ_FORMAT_TAGGED, .size = 64};
	struct fid_cq *cq = NULL;
	REQUIRE(fi_cq_open(d, &attr, &cq, NULL) == 0);
	return cq;
}

/* An enabled endpoint of `info` in `d`, reporting on `eq` and `cq`. */
static struct fid_ep *ep_open(struct fid_domain *d, struct fi_info *info, struct fid_eq *eq,
			      struct fid_cq *cq)
{
	struct fid_ep *ep = NULL;
	REQUIRE(fi_endpoint(d, info, &ep, (void *)0x5151) == 0);
	REQUIRE(fi_ep_bind(ep, &eq->fid, 0) == 0);
	REQUIRE(fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV) == 0);
	if (d == da) {
		REQUIRE(fi_ep_bind(ep, &rwrite->fid, FI_REMOTE_WRITE) == 0);
		REQUIRE(fi_ep_bind(ep, &rread->fid, FI_REMOTE_READ) == 0);
	}
	REQUIRE(fi_enable(ep) == 0);
	return ep;
}

/* The next event of `eq` within 10 s: its kind and entry, or a negative errno. */
static ssize_t next_event(struct fid_eq *eq, uint32_t *event, struct cm_entry *c)
{
	memset(c, 0, sizeof(*c));
	return fi_eq_sread(eq, event, c, sizeof(*c), 10000, 0);
}

static void getinfo(void)
{
	struct fi_info *h = ct_hints(FI_MSG | FI_RMA | FI_RMA_EVENT, 1);
	h->ep_attr->type = FI_EP_MSG;
	h->tx_attr->op_flags = FI_COMPLETION;
	REQUIRE(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &list) == 0);
	CHECK_EQ(list->tx_attr->op_flags, FI_COMPLETION);
	REQUIRE(list && list->next);
	CHECK_EQ(list->ep_attr->type, FI_EP_MSG);
	CHECK(list->caps & FI_RMA);
	CHECK(list->caps & FI_RMA_EVENT);
	CHECK_EQ(list->caps & FI_TAGGED, 0);
	CHECK(strcmp(list->domain_attr->name, "rb0") == 0);
	CHECK(strcmp(list->next->domain_attr->name, "rb1") == 0);
	/* Tagged messages for those that ask (msgtag.c). */
	struct fi_info *tagged = NULL;
	h->caps = FI_MSG | FI_TAGGED;
	REQUIRE(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &tagged) == 0);
	CHECK(tagged->caps & FI_TAGGED);
	fi_freeinfo(tagged);
	fi_freeinfo(h);
}

static void setup(void)
{
	REQUIRE(fi_fabric(list->fabric_attr, &fab, NULL) == 0);
	REQUIRE(fi_domain(fab, list, &da, NULL) == 0);
	REQUIRE(fi_domain(fab, list->next, &db, NULL) == 0);
	eqa = eq_open();
	eqb = eq_open();
	cqa = cq_open(da);
	cqb = cq_open(db);
	struct fi_cntr_attr cntr_attr = {.events = FI_CNTR_EVENTS_COMP};
	REQUIRE(fi_cntr_open(da, &cntr_attr, &rwrite, NULL) == 0);
	REQUIRE(fi_cntr_open(da, &cntr_attr, &rread, NULL) == 0);
	abuf = ct_pages(BUFLEN);
	bbuf = ct_pages(BUFLEN);
	REQUIRE(fi_mr_reg(da, abuf, BUFLEN, FI_SEND | FI_RECV | FI_REMOTE_WRITE | FI_REMOTE_READ, 0,
			  0, 0, &amr, NULL) == 0);
	REQUIRE(fi_mr_reg(db, bbuf, BUFLEN, FI_SEND | FI_RECV | FI_WRITE | FI_READ, 0, 0, 0, &bmr,
			  NULL) == 0);

	/* Event queues wait by polling, on a file descriptor or on a mutex and condition
	 * (fdwait.c): no wait set or pollfd list. */
	struct fi_eq_attr fd_attr = {.size = 4, .wait_obj = FI_WAIT_POLLFD};
	struct fid_eq *fdq = NULL;
	CHECK_EQ(fi_eq_open(fab, &fd_attr, &fdq, NULL), -FI_ENOSYS);
	fd_attr.wait_obj = FI_WAIT_SET;
	CHECK_EQ(fi_eq_open(fab, &fd_attr, &fdq, NULL), -FI_ENOSYS);

	/* A passive endpoint needs an event queue to listen. */
	struct fid_pep *bare = NULL;
	REQUIRE(fi_passive_ep(fab, list, &bare, NULL) == 0);
	CHECK_EQ(fi_listen(bare), -FI_ENOEQ);
	CHECK_EQ(fi_close(&bare->fid), 0);

	REQUIRE(fi_passive_ep(fab, list, &pep, (void *)0x9e9) == 0);
	REQUIRE(fi_pep_bind(pep, &eqa->fid, 0) == 0);
	REQUIRE(fi_listen(pep) == 0);
	size_t len = sizeof(pepname);
	REQUIRE(fi_getname(&pep->fid, pepname, &len) == 0);
	CHECK_EQ(len, 16);
	size_t v = 0, vl = sizeof(v);
	CHECK_EQ(fi_getopt(&pep->fid, FI_OPT_ENDPOINT, FI_OPT_CM_DATA_SIZE, &v, &vl), 0);
	CHECK(v >= 32);
}

/* B connects to the passive endpoint with `req`; A answers the request (accepting with
 * `rep`, or rejecting when `accept` is 0). Returns A's endpoint (NULL when rejected). */
static struct fid_ep *handshake(struct fid_ep *b, int accept)
{
	struct cm_entry c;
	uint32_t ev = 0;
	static const char req[] = "hello from b", rep[] = "welcome";
	CHECK_EQ(fi_connect(b, pepname, req, sizeof(req)), 0);
	if (next_event(eqa, &ev, &c) != (ssize_t)(sizeof(c.e) + sizeof(req))) {
		CHECK(!"a connection request");
		return NULL;
	}
	CHECK_EQ(ev, FI_CONNREQ);
	CHECK(c.e.fid == &pep->fid);
	CHECK(c.e.info != NULL && c.e.info->handle != NULL);
	CHECK(memcmp(c.data, req, sizeof(req)) == 0);
	if (!c.e.info)
		return NULL;
	CHECK_EQ(c.e.info->ep_attr->type, FI_EP_MSG);
	/* What the listener's info asked (its modes, capabilities and default operation
	 * flags) holds for the endpoint that accepts. */
	CHECK_EQ(c.e.info->caps, list->caps);
	CHECK_EQ(c.e.info->mode, list->mode);
	CHECK_EQ(c.e.info->rx_attr->mode, list->rx_attr->mode);
	CHECK_EQ(c.e.info->tx_attr->op_flags, FI_COMPLETION);
	CHECK_EQ(c.e.info->rx_attr->op_flags, list->rx_attr->op_flags);
	/* The fabric progresses while the request waits for its answer (which must not make
	 * its connection manager drop it). */
	struct cm_entry other;
	CHECK_EQ(fi_eq_read(eqb, &ev, &other, sizeof(other), 0), -FI_EAGAIN);
	if (!accept) {
		static const char no[] = "busy";
		CHECK_EQ(fi_reject(pep, c.e.info->handle, no, sizeof(no)), 0);
		fi_freeinfo(c.e.info);
		struct fi_eq_err_entry err = {0};
		CHECK_EQ(next_event(eqb, &ev, &c), -FI_EAVAIL);
		CHECK_EQ(fi_eq_readerr(eqb, &err, 0), sizeof(err));
		CHECK_EQ(err.err, FI_ECONNREFUSED);
		CHECK(err.fid == &b->fid);
		return NULL;
	}
	struct fid_ep *a = ep_open(da, c.e.info, eqa, cqa);
	fi_freeinfo(c.e.info);
	CHECK_EQ(fi_accept(a, rep, sizeof(rep)), 0);
	CHECK_EQ(next_event(eqb, &ev, &c), sizeof(c.e) + sizeof(rep));
	CHECK_EQ(ev, FI_CONNECTED);
	CHECK(c.e.fid == &b->fid);
	CHECK(memcmp(c.data, rep, sizeof(rep)) == 0);
	CHECK(next_event(eqa, &ev, &c) >= (ssize_t)sizeof(c.e));
	CHECK_EQ(ev, FI_CONNECTED);
	CHECK(c.e.fid == &a->fid);
	return a;
}

/* A multi-receive buffer of A (FI_MULTI_RECV on a connection): B sends `n` messages of
 * 1000 bytes at once, which land one after the other in it; the one that leaves less than
 * FI_OPT_MIN_MULTI_RECV (1000) free carries FI_MULTI_RECV. */
static void multi_recv(struct fid_ep *a, struct fid_ep *b, int n)
{
	struct fi_cq_tagged_entry e;
	size_t min = 1000;
	CHECK_EQ(fi_setopt(&a->fid, FI_OPT_ENDPOINT, FI_OPT_MIN_MULTI_RECV, &min, sizeof(min)), 0);
	struct iovec iov = {.iov_base = abuf + 40000, .iov_len = 1000 * n + 500};
	void *desc = fi_mr_desc(amr);
	struct fi_msg m = {.msg_iov = &iov, .desc = &desc, .iov_count = 1, .context = (void *)0xa5};
	/* A plain receive before it takes the first message. */
	CHECK_EQ(fi_recv(a, abuf + 30000, 64, fi_mr_desc(amr), 0, (void *)0xa6), 0);
	CHECK_EQ(fi_recvmsg(a, &m, FI_MULTI_RECV), 0);
	CHECK_EQ(fi_send(b, bbuf, 10, fi_mr_desc(bmr), 0, (void *)0xb6), 0);
	CHECK(ct_wait(cqb, &e) && e.op_context == (void *)0xb6);
	CHECK(ct_wait(cqa, &e) && e.op_context == (void *)0xa6 && e.len == 10);
	/* One posted after it waits for its release. */
	CHECK_EQ(fi_recv(a, abuf + 30000, 64, fi_mr_desc(amr), 0, (void *)0xa7), 0);
	for (int i = 0; i < n; i++) {
		ct_fill(bbuf + 1000 * i, 1000, 40 + i);
		CHECK_EQ(fi_send(b, bbuf + 1000 * i, 1000, fi_mr_desc(bmr), 0, (void *)0xb5), 0);
	}
	for (int i = 0; i < n; i++) {
		CHECK(ct_wait(cqb, &e) && e.op_context == (void *)0xb5);
		if (!ct_wait(cqa, &e)) {
			CHECK(!"a multi-receive completion");
			return;
		}
		CHECK(e.op_context == (void *)0xa5);
		CHECK_EQ(e.len, 1000);
		CHECK(e.buf == abuf + 40000 + 1000 * i);
		CHECK(ct_same(e.buf, 1000, 40 + i));
		CHECK_EQ(!!(e.flags & FI_MULTI_RECV), i == n - 1);
	}
}

static void traffic(struct fid_ep *a, struct fid_ep *b)
{
	struct fi_cq_tagged_entry e;
	/* B to A: a message (the address argument means nothing on a connection). */
	CHECK_EQ(fi_recv(a, abuf, 4096, fi_mr_desc(amr), 0, (void *)0xa1), 0);
	ct_fill(bbuf, 3000, 1);
	CHECK_EQ(fi_send(b, bbuf, 3000, fi_mr_desc(bmr), 0, (void *)0xb1), 0);
	CHECK(ct_wait(cqb, &e) && e.op_context == (void *)0xb1);
	CHECK(ct_wait(cqa, &e) && e.op_context == (void *)0xa1 && e.len == 3000);
	CHECK(ct_same(abuf, 3000, 1));
	/* A to B. */
	CHECK_EQ(fi_recv(b, bbuf + 8192, 64, fi_mr_desc(bmr), 0, (void *)0xb2), 0);
	ct_fill(abuf + 8192, 40, 2);
	CHECK_EQ(fi_send(a, abuf + 8192, 40, fi_mr_desc(amr), 0, (void *)0xa2), 0);
	CHECK(ct_wait(cqa, &e) && e.op_context == (void *)0xa2);
	CHECK(ct_wait(cqb, &e) && e.op_context == (void *)0xb2 && e.len == 40);
	CHECK(ct_same(bbuf + 8192, 40, 2));
	/* B writes into A's region and reads it back. */
	ct_fill(bbuf + 16384, 5000, 3);
	CHECK_EQ(fi_write(b, bbuf + 16384, 5000, fi_mr_desc(bmr), 0, (uint64_t)(abuf + 20000),
			  fi_mr_key(amr), (void *)0xb3),
		 0);
	CHECK(ct_wait(cqb, &e) && e.op_context == (void *)0xb3);
	CHECK(ct_same(abuf + 20000, 5000, 3));
	memset(bbuf + 32768, 0, 5000);
	CHECK_EQ(fi_read(b, bbuf + 32768, 5000, fi_mr_desc(bmr), 0, (uint64_t)(abuf + 20000),
			 fi_mr_key(amr), (void *)0xb4),
		 0);
	CHECK(ct_wait(cqb, &e) && e.op_context == (void *)0xb4);
	CHECK(ct_same(bbuf + 32768, 5000, 3));
	/* A's endpoint counted them, with no host involved (FI_RMA_EVENT). */
	CHECK_EQ(fi_cntr_wait(rwrite, 1, 5000), 0);
	CHECK_EQ(fi_cntr_wait(rread, 1, 5000), 0);
	CHECK_EQ(fi_cntr_read(rwrite), 1);
	CHECK_EQ(fi_cntr_read(rread), 1);
}

/* A passive endpoint on rb0 and a connected endpoint on rb1 opened from infos naming the
 * same service number (FI_SOURCE): a connection to this host's address and that number
 * reaches the listener (the connected endpoint does not take the number over). */
static void named_listener(void)
{
	static const char *service = "47123";
	struct fi_info *h = ct_hints(FI_MSG, 1), *src = NULL, *dst = NULL;
	h->ep_attr->type = FI_EP_MSG;
	REQUIRE(fi_getinfo(CT_VERSION, NULL, service, FI_SOURCE, h, &src) == 0);
	REQUIRE(src && src->next);
	REQUIRE(fi_getinfo(CT_VERSION, "127.0.0.1", service, 0, h, &dst) == 0);
	fi_freeinfo(h);
	struct fid_pep *p2 = NULL;
	REQUIRE(fi_passive_ep(fab, src, &p2, NULL) == 0);
	REQUIRE(fi_pep_bind(p2, &eqa->fid, 0) == 0);
	REQUIRE(fi_listen(p2) == 0);
	struct fid_ep *same = ep_open(db, src->next, eqb, cqb);
	struct fid_ep *b4 = ep_open(db, list->next, eqb, cqb);
	CHECK_EQ(fi_connect(b4, dst->dest_addr, NULL, 0), 0);
	struct cm_entry c;
	uint32_t ev = 0;
	CHECK(next_event(eqa, &ev, &c) >= (ssize_t)sizeof(c.e));
	CHECK_EQ(ev, FI_CONNREQ);
	CHECK(c.e.fid == &p2->fid);
	if (c.e.info) {
		CHECK_EQ(fi_reject(p2, c.e.info->handle, NULL, 0), 0);
		fi_freeinfo(c.e.info);
		struct fi_eq_err_entry err = {0};
		CHECK_EQ(next_event(eqb, &ev, &c), -FI_EAVAIL);
		CHECK_EQ(fi_eq_readerr(eqb, &err, 0), sizeof(err));
		CHECK_EQ(err.err, FI_ECONNREFUSED);
	}
	CHECK_EQ(fi_close(&b4->fid), 0);
	CHECK_EQ(fi_close(&same->fid), 0);
	CHECK_EQ(fi_close(&p2->fid), 0);
	fi_freeinfo(src);
	fi_freeinfo(dst);
}

int main(void)
{
	ct_name = "msgep";
	getinfo();
	setup();
	struct cm_entry c;
	uint32_t ev = 0;

	/* Not connected yet: nothing to send over; an endpoint needs its event queue. */
	struct fid_ep *b = NULL, *lone = NULL;
	REQUIRE(fi_endpoint(db, list->next, &lone, NULL) == 0);
	REQUIRE(fi_ep_bind(lone, &cqb->fid, FI_TRANSMIT | FI_RECV) == 0);
	CHECK_EQ(fi_enable(lone), -FI_ENOEQ);
	CHECK_EQ(fi_close(&lone->fid), 0);
	b = ep_open(db, list->next, eqb, cqb);
	CHECK_EQ(fi_send(b, bbuf, 8, fi_mr_desc(bmr), 0, NULL), -FI_ENOTCONN);
	CHECK_EQ(fi_connect(b, NULL, NULL, 0), -FI_EINVAL);
	char big[4096] = {0};
	CHECK_EQ(fi_connect(b, pepname, big, sizeof(big)), -FI_EINVAL);
	/* A too small buffer for an event. */
	CHECK_EQ(fi_eq_read(eqa, &ev, &c, 4, 0), -FI_EAGAIN);

	struct fid_ep *a = handshake(b, 1);
	REQUIRE(a != NULL);
	CHECK_EQ(fi_connect(b, pepname, NULL, 0), -FI_EISCONN);
	size_t v = 0, vl = sizeof(v);
	CHECK_EQ(fi_getopt(&b->fid, FI_OPT_ENDPOINT, FI_OPT_CM_DATA_SIZE, &v, &vl), 0);
	CHECK(v >= 32);
	traffic(a, b);
	multi_recv(a, b, 5);

	named_listener();

	/* A second endpoint of B, rejected. */
	struct fid_ep *b2 = ep_open(db, list->next, eqb, cqb);
	CHECK(handshake(b2, 0) == NULL);
	CHECK_EQ(fi_close(&b2->fid), 0);

	/* Nobody listens on this number: refused. */
	struct fid_ep *b3 = ep_open(db, list->next, eqb, cqb);
	char nobody[16];
	memcpy(nobody, pepname, 16);
	nobody[8] ^= 0x55;
	CHECK_EQ(fi_connect(b3, nobody, NULL, 0), 0);
	struct fi_eq_err_entry err = {0};
	CHECK_EQ(next_event(eqb, &ev, &c), -FI_EAVAIL);
	CHECK_EQ(fi_eq_readerr(eqb, &err, 0), sizeof(err));
	CHECK_EQ(err.err, FI_ECONNREFUSED);
	CHECK(err.fid == &b3->fid);
	CHECK_EQ(fi_close(&b3->fid), 0);

	/* B shuts the connection down: A hears of it. */
	CHECK_EQ(fi_shutdown(b, 0), 0);
	int shut = 0;
	for (int i = 0; i < 4 && !shut; i++) {
		if (next_event(eqa, &ev, &c) < 0)
			break;
		shut = ev == FI_SHUTDOWN && c.e.fid == &a->fid;
	}
	CHECK(shut);

	CHECK_EQ(fi_close(&a->fid), 0);
	CHECK_EQ(fi_close(&b->fid), 0);
	CHECK_EQ(fi_close(&pep->fid), 0);
	CHECK_EQ(fi_close(&amr->fid), 0);
	CHECK_EQ(fi_close(&bmr->fid), 0);
	CHECK_EQ(fi_close(&rwrite->fid), 0);
	CHECK_EQ(fi_close(&rread->fid), 0);
	CHECK_EQ(fi_close(&cqa->fid), 0);
	CHECK_EQ(fi_close(&cqb->fid), 0);
	CHECK_EQ(fi_close(&eqa->fid), 0);
	CHECK_EQ(fi_close(&eqb->fid), 0);
	CHECK_EQ(fi_close(&da->fid), 0);
	CHECK_EQ(fi_close(&db->fid), 0);
	CHECK_EQ(fi_close(&fab->fid), 0);
	fi_freeinfo(list);
	return ct_summary_exit();
}
