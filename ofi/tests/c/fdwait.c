/* fdwait.c: file-descriptor wait objects (FI_WAIT_FD) of completion and event queues, and
 * fi_trywait(3), used as fi_trywait(3) and fi_cq(3) say: read, and when nothing is there,
 * fi_trywait and, if it says FI_SUCCESS, block on the descriptor fi_control(FI_GETWAIT)
 * gave. Every block waits at most 10 s; one that times out is a wake-up that never came.
 *
 * Run "local" on the provider's in-process fabric (one thread moves everything, so
 * fi_trywait must not say FI_SUCCESS while a message is still on its way) and "served" on
 * `ringbell-emu serve` (the waits sleep until the NIC's interrupt). Both: the wait object's
 * control calls and their refusals, a message and a large one waited for, the descriptor
 * readable while an entry waits, a waiter woken by another thread's send, a connection
 * of FI_EP_MSG endpoints whose event queues are waited on the same way (and events the
 * application writes to them, fi_eq_write), and a wait set
 * (fi_wait_open, fi_wait) of a CQ and a counter, and a counter with a descriptor; and
 * the mutex and condition of FI_WAIT_MUTEX_COND queues and wait sets.
 */
#include "ctest.h"
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/time.h>

static struct ct_pair P;
static int served;
static char *abuf, *bbuf;
static struct fid_mr *amr, *bmr;
static int fda, fdb;
static int blocks, missed;
#define BUFLEN (1 << 20)

static int readable(int fd, int ms)
{
	struct pollfd p = {.fd = fd, .events = POLLIN};
	return poll(&p, 1, ms);
}

static int wait_fd(fid_t f)
{
	int fd = -1;
	CHECK_EQ(fi_control(f, FI_GETWAIT, &fd), 0);
	CHECK(fd >= 0);
	return fd;
}

/* fi_trywait on `f`, then a block on `fd` if it allows: 1 when it blocked, 0 when it
 * said -FI_EAGAIN, -1 on anything else. */
static int try_block(fid_t f, int fd)
{
	int t = fi_trywait(P.fab, &f, 1);
	if (t == -FI_EAGAIN)
		return 0;
	CHECK_EQ(t, 0);
	if (t)
		return -1;
	blocks++;
	if (readable(fd, 10000) != 1) {
		missed++;
		CHECK(!"a wake-up within 10 s");
	}
	return 1;
}

/* One entry of `cq` (descriptor `fd`), waited for as above, within 30 s. */
static ssize_t fd_read(struct fid_cq *cq, int fd, struct fi_cq_tagged_entry *e)
{
	double end = ct_now() + 30;
	ssize_t r;
	while ((r = fi_cq_read(cq, e, 1)) == -FI_EAGAIN && ct_now() < end)
		if (try_block(&cq->fid, fd) < 0)
			break;
	return r;
}

static void controls(void)
{
	enum fi_wait_obj w = FI_WAIT_NONE;
	CHECK_EQ(fi_control(&P.a.cq->fid, FI_GETWAITOBJ, &w), 0);
	CHECK_EQ(w, FI_WAIT_FD);
	CHECK_EQ(fi_control(&P.a.cq->fid, FI_GETWAIT, NULL), -FI_EINVAL);
	fda = wait_fd(&P.a.cq->fid);
	fdb = wait_fd(&P.b.cq->fid);
	CHECK(fda != fdb);

	/* A CQ without a descriptor: none to give, and nothing fi_trywait can wait on. */
	struct fi_cq_attr attr = {.format = FI_CQ_FORMAT_CONTEXT, .wait_obj = FI_WAIT_NONE};
	struct fid_cq *plain = NULL;
	REQUIRE(fi_cq_open(P.a.dom, &attr, &plain, NULL) == 0);
	int fd = -7;
	CHECK_EQ(fi_control(&plain->fid, FI_GETWAIT, &fd), -FI_ENODATA);
	CHECK_EQ(fd, -7);
	CHECK_EQ(fi_control(&plain->fid, FI_GETWAITOBJ, &w), 0);
	CHECK_EQ(w, FI_WAIT_NONE);
	struct fid *bad[2] = {&P.a.cq->fid, &plain->fid};
	CHECK_EQ(fi_trywait(P.fab, bad, 2), -FI_EINVAL);
	bad[1] = &P.a.ep->fid;
	CHECK_EQ(fi_trywait(P.fab, bad, 2), -FI_EINVAL);
	CHECK_EQ(fi_trywait(P.fab, NULL, 1), -FI_EINVAL);
	CHECK_EQ(fi_trywait(P.fab, bad, -1), -FI_EINVAL);
	CHECK_EQ(fi_trywait(P.fab, bad, 0), 0);
	CHECK_EQ(fi_close(&plain->fid), 0);
}

/* Nothing posted: fi_trywait lets both CQs be waited on (in-process once the fabric is
 * idle), and in-process nothing makes either descriptor readable. */
static void idle(void)
{
	struct fid *both[2] = {&P.a.cq->fid, &P.b.cq->fid};
	int t = -FI_EAGAIN;
	for (int i = 0; i < 100000 && t == -FI_EAGAIN; i++)
		t = fi_trywait(P.fab, both, 2);
	CHECK_EQ(t, 0);
	if (!served) {
		CHECK_EQ(readable(fda, 0), 0);
		CHECK_EQ(readable(fdb, 0), 0);
	}
}

/* A to B, `len` bytes, both completions waited for on the descriptors. */
static void message(size_t len, unsigned seed)
{
	struct fi_cq_tagged_entry e;
	memset(bbuf, 0, len);
	CHECK_EQ(fi_recv(P.b.ep, bbuf, len, fi_mr_desc(bmr), P.b.peer, (void *)0xb1), 0);
	ct_fill(abuf, len, seed);
	CHECK_EQ(fi_send(P.a.ep, abuf, len, fi_mr_desc(amr), P.a.peer, (void *)0xa1), 0);
	CHECK_EQ(fd_read(P.b.cq, fdb, &e), 1);
	CHECK(e.op_context == (void *)0xb1 && e.len == len);
	CHECK(ct_same(bbuf, len, seed));
	CHECK_EQ(fd_read(P.a.cq, fda, &e), 1);
	CHECK(e.op_context == (void *)0xa1);
	if (!served)
		/* Read empty: the descriptor is quiet again. */
		CHECK_EQ(readable(fdb, 0), 0);
}

/* While an entry waits in B's CQ (queued by progress that reading A's CQ ran), B's
 * descriptor is readable; reading the entry makes it quiet (in-process). */
static void readable_while_queued(void)
{
	struct fi_cq_tagged_entry e;
	CHECK_EQ(fi_recv(P.b.ep, bbuf, 64, fi_mr_desc(bmr), P.b.peer, (void *)0xb2), 0);
	CHECK_EQ(fi_send(P.a.ep, abuf, 64, fi_mr_desc(amr), P.a.peer, (void *)0xa2), 0);
	CHECK(ct_wait(P.a.cq, &e) && e.op_context == (void *)0xa2);
	/* The receive may complete after the send (served NICs run on their own). */
	double end = ct_now() + 10;
	while (readable(fdb, 0) != 1 && ct_now() < end)
		(void)fi_cq_read(P.a.cq, &e, 1);
	CHECK_EQ(readable(fdb, 0), 1);
	CHECK_EQ(fi_cq_read(P.b.cq, &e, 1), 1);
	CHECK(e.op_context == (void *)0xb2);
	if (!served)
		CHECK_EQ(readable(fdb, 0), 0);
}

static void *sender(void *arg)
{
	struct fi_cq_tagged_entry e;
	usleep(50000);
	ct_fill(abuf, 3000, 9);
	CHECK_EQ(fi_send(P.a.ep, abuf, 3000, fi_mr_desc(amr), P.a.peer, (void *)0xa3), 0);
	CHECK(ct_wait(P.a.cq, &e) && e.op_context == (void *)0xa3);
	return arg;
}

/* B blocks on its descriptor before anything is sent; another thread sends. */
static void woken_by_another_thread(void)
{
	struct fi_cq_tagged_entry e;
	memset(bbuf, 0, 3000);
	CHECK_EQ(fi_recv(P.b.ep, bbuf, 4096, fi_mr_desc(bmr), P.b.peer, (void *)0xb3), 0);
	struct fid *f = &P.b.cq->fid;
	int t = -FI_EAGAIN;
	for (int i = 0; i < 100000 && t == -FI_EAGAIN; i++)
		t = fi_trywait(P.fab, &f, 1);
	CHECK_EQ(t, 0);
	pthread_t th;
	REQUIRE(pthread_create(&th, NULL, sender, NULL) == 0);
	CHECK_EQ(readable(fdb, 10000), 1);
	CHECK_EQ(fd_read(P.b.cq, fdb, &e), 1);
	CHECK(e.op_context == (void *)0xb3 && e.len == 3000);
	CHECK(ct_same(bbuf, 3000, 9));
	pthread_join(th, NULL);
}

/* Served: B's CQ waited on before A sends, and nothing in this process progresses while
 * it sleeps; the descriptor becomes readable by the NIC's interrupt alone. */
static void interrupt_wakes(void)
{
	struct fi_cq_tagged_entry e;
	CHECK_EQ(fi_recv(P.b.ep, bbuf, 4096, fi_mr_desc(bmr), P.b.peer, (void *)0xb4), 0);
	struct fid *f = &P.b.cq->fid;
	CHECK_EQ(fi_trywait(P.fab, &f, 1), 0);
	ct_fill(abuf, 2000, 11);
	CHECK_EQ(fi_send(P.a.ep, abuf, 2000, fi_mr_desc(amr), P.a.peer, (void *)0xa4), 0);
	CHECK_EQ(readable(fdb, 10000), 1);
	CHECK_EQ(fi_cq_read(P.b.cq, &e, 1), 1);
	CHECK(e.op_context == (void *)0xb4 && e.len == 2000);
	CHECK(ct_same(bbuf, 2000, 11));
	CHECK(ct_wait(P.a.cq, &e) && e.op_context == (void *)0xa4);
}

static volatile sig_atomic_t alarms;

static void on_alarm(int sig)
{
	(void)sig;
	alarms++;
}

/* Served: fi_cq_sread sleeps on the NIC's interrupt and wakes for a completion that comes
 * while it sleeps (B's receive, A's send from another thread); a signal handler installed
 * without SA_RESTART ends a sleeping fi_cq_sread with -FI_EINTR, as libfabric's own
 * waits end (a timer rings every 20 ms until one lands in the sleep). */
static void sread_sleeps(void)
{
	struct fi_cq_tagged_entry e;
	memset(bbuf, 0, 3000);
	CHECK_EQ(fi_recv(P.b.ep, bbuf, 4096, fi_mr_desc(bmr), P.b.peer, (void *)0xb5), 0);
	pthread_t th;
	REQUIRE(pthread_create(&th, NULL, sender, NULL) == 0);
	CHECK_EQ(fi_cq_sread(P.b.cq, &e, 1, NULL, 10000), 1);
	CHECK(e.op_context == (void *)0xb5 && e.len == 3000);
	CHECK(ct_same(bbuf, 3000, 9));
	pthread_join(th, NULL);

	struct sigaction sa = {.sa_handler = on_alarm}, old;
	sigemptyset(&sa.sa_mask);
	REQUIRE(sigaction(SIGALRM, &sa, &old) == 0);
	struct itimerval every = {.it_interval = {0, 20000}, .it_value = {0, 20000}}, off = {0};
	REQUIRE(setitimer(ITIMER_REAL, &every, NULL) == 0);
	ssize_t r = fi_cq_sread(P.b.cq, &e, 1, NULL, 5000);
	setitimer(ITIMER_REAL, &off, NULL);
	sigaction(SIGALRM, &old, NULL);
	CHECK_EQ(r, -FI_EINTR);
	CHECK(alarms > 0);
}

/* An enabled endpoint of side `s` bound to `s`'s AV and to `cq`; its address in the
 * other side's AV is *addr. */
static struct fid_ep *extra_ep(struct ct_side *s, struct ct_side *other, struct fid_cq *cq,
			       fi_addr_t *addr)
{
	struct fid_ep *ep = NULL;
	char name[64];
	size_t len = sizeof(name);
	REQUIRE(fi_endpoint(s->dom, s->info, &ep, NULL) == 0);
	REQUIRE(fi_ep_bind(ep, &s->av->fid, 0) == 0);
	REQUIRE(fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV) == 0);
	REQUIRE(fi_enable(ep) == 0);
	REQUIRE(fi_getname(&ep->fid, name, &len) == 0);
	REQUIRE(fi_av_insert(other->av, name, 1, addr, 0, NULL) == 1);
	return ep;
}

/* A wait set (fi_wait(3)) holding B's CQ of a second pair of endpoints and a counter. */
static void wait_set(void)
{
	struct fi_wait_attr attr = {.wait_obj = FI_WAIT_UNSPEC};
	struct fid_wait *set = NULL;
	CHECK_EQ(fi_wait_open(P.fab, NULL, &set), -FI_EINVAL);
	attr.flags = 1;
	CHECK_EQ(fi_wait_open(P.fab, &attr, &set), -FI_EINVAL);
	attr.flags = 0;
	attr.wait_obj = FI_WAIT_POLLFD;
	CHECK_EQ(fi_wait_open(P.fab, &attr, &set), -FI_ENOSYS);
	attr.wait_obj = (enum fi_wait_obj)55;
	CHECK_EQ(fi_wait_open(P.fab, &attr, &set), -FI_EINVAL);
	attr.wait_obj = FI_WAIT_UNSPEC;
	REQUIRE(fi_wait_open(P.fab, &attr, &set) == 0);
	enum fi_wait_obj w = FI_WAIT_NONE;
	CHECK_EQ(fi_control(&set->fid, FI_GETWAITOBJ, &w), 0);
	CHECK_EQ(w, FI_WAIT_UNSPEC);
	int fd = wait_fd(&set->fid);

	struct fi_cq_attr cattr = {.format = FI_CQ_FORMAT_TAGGED, .size = 64,
				   .wait_obj = FI_WAIT_SET};
	struct fid_cq *cqa = NULL, *cqb = NULL;
	CHECK_EQ(fi_cq_open(P.b.dom, &cattr, &cqb, NULL), -FI_EINVAL); /* no set named */
	cattr.wait_set = (struct fid_wait *)P.b.cq;
	CHECK_EQ(fi_cq_open(P.b.dom, &cattr, &cqb, NULL), -FI_EINVAL); /* not a set */
	cattr.wait_set = set;
	REQUIRE(fi_cq_open(P.b.dom, &cattr, &cqb, NULL) == 0);
	cattr.wait_obj = FI_WAIT_NONE;
	cattr.wait_set = NULL;
	REQUIRE(fi_cq_open(P.a.dom, &cattr, &cqa, NULL) == 0);
	struct fi_cntr_attr nattr = {.events = FI_CNTR_EVENTS_COMP, .wait_obj = FI_WAIT_SET,
				     .wait_set = set};
	struct fid_cntr *cntr = NULL;
	REQUIRE(fi_cntr_open(P.b.dom, &nattr, &cntr, NULL) == 0);
	CHECK_EQ(fi_close(&set->fid), -FI_EBUSY);

	/* Nothing yet. */
	CHECK_EQ(fi_wait(set, 0), -FI_ETIMEDOUT);
	/* A counter's change is reported once. */
	CHECK_EQ(fi_cntr_add(cntr, 3), 0);
	CHECK_EQ(fi_wait(set, 1000), 0);
	CHECK_EQ(fi_wait(set, 0), -FI_ETIMEDOUT);

	/* A message to B's CQ in the set. */
	fi_addr_t to_b, to_a;
	struct fid_ep *eb = extra_ep(&P.b, &P.a, cqb, &to_b);
	struct fid_ep *ea = extra_ep(&P.a, &P.b, cqa, &to_a);
	struct fi_cq_tagged_entry e;
	memset(bbuf, 0, 500);
	CHECK_EQ(fi_recv(eb, bbuf, 4096, fi_mr_desc(bmr), to_a, (void *)0xc1), 0);
	ct_fill(abuf, 500, 21);
	CHECK_EQ(fi_send(ea, abuf, 500, fi_mr_desc(amr), to_b, (void *)0xc2), 0);
	CHECK_EQ(fi_wait(set, 10000), 0);
	CHECK_EQ(fi_cq_read(cqb, &e, 1), 1);
	CHECK(e.op_context == (void *)0xc1 && e.len == 500);
	CHECK(ct_same(bbuf, 500, 21));
	CHECK(ct_wait(cqa, &e) && e.op_context == (void *)0xc2);
	if (!served)
		CHECK_EQ(readable(fd, 0), 0);
	CHECK_EQ(fi_wait(set, 0), -FI_ETIMEDOUT);

	CHECK_EQ(fi_close(&ea->fid), 0);
	CHECK_EQ(fi_close(&eb->fid), 0);
	CHECK_EQ(fi_close(&cqa->fid), 0);
	CHECK_EQ(fi_close(&cqb->fid), 0);
	CHECK_EQ(fi_close(&cntr->fid), 0);
	CHECK_EQ(fi_close(&set->fid), 0);
}

/* A counter with a descriptor (FI_WAIT_FD): quiet until it changes, fi_trywait reports a
 * change once, a read quiets it, and a receive counted on it wakes a waiter. */
static void counter_waits(void)
{
	struct fi_cntr_attr attr = {.events = FI_CNTR_EVENTS_COMP, .wait_obj = FI_WAIT_FD};
	struct fid_cntr *cntr = NULL;
	REQUIRE(fi_cntr_open(P.b.dom, &attr, &cntr, NULL) == 0);
	enum fi_wait_obj w = FI_WAIT_NONE;
	CHECK_EQ(fi_control(&cntr->fid, FI_GETWAITOBJ, &w), 0);
	CHECK_EQ(w, FI_WAIT_FD);
	int fd = wait_fd(&cntr->fid);
	struct fid *f = &cntr->fid;
	int t = -FI_EAGAIN;
	for (int i = 0; i < 100000 && t == -FI_EAGAIN; i++)
		t = fi_trywait(P.fab, &f, 1);
	CHECK_EQ(t, 0);
	if (!served)
		CHECK_EQ(readable(fd, 0), 0);
	/* A change: readable once progress saw it; fi_trywait reports it once. */
	CHECK_EQ(fi_cntr_add(cntr, 2), 0);
	struct fi_cq_tagged_entry e;
	(void)fi_cq_read(P.b.cq, &e, 1);
	CHECK_EQ(readable(fd, 0), 1);
	CHECK_EQ(fi_trywait(P.fab, &f, 1), -FI_EAGAIN);
	t = -FI_EAGAIN;
	for (int i = 0; i < 100000 && t == -FI_EAGAIN; i++)
		t = fi_trywait(P.fab, &f, 1);
	CHECK_EQ(t, 0);
	CHECK_EQ(fi_cntr_read(cntr), 2);
	if (!served)
		CHECK_EQ(readable(fd, 0), 0);

	/* Receives of a new endpoint of B counted on it. */
	struct fi_cq_attr cattr = {.format = FI_CQ_FORMAT_TAGGED, .size = 64};
	struct fid_cq *cq = NULL;
	REQUIRE(fi_cq_open(P.b.dom, &cattr, &cq, NULL) == 0);
	struct fid_ep *eb = NULL;
	char name[64];
	size_t len = sizeof(name);
	fi_addr_t to_b;
	REQUIRE(fi_endpoint(P.b.dom, P.b.info, &eb, NULL) == 0);
	REQUIRE(fi_ep_bind(eb, &P.b.av->fid, 0) == 0);
	REQUIRE(fi_ep_bind(eb, &cq->fid, FI_TRANSMIT | FI_RECV) == 0);
	REQUIRE(fi_ep_bind(eb, &cntr->fid, FI_RECV) == 0);
	REQUIRE(fi_enable(eb) == 0);
	REQUIRE(fi_getname(&eb->fid, name, &len) == 0);
	REQUIRE(fi_av_insert(P.a.av, name, 1, &to_b, 0, NULL) == 1);
	CHECK_EQ(fi_recv(eb, bbuf, 4096, fi_mr_desc(bmr), FI_ADDR_UNSPEC, (void *)0xd1), 0);
	t = -FI_EAGAIN;
	for (int i = 0; i < 100000 && t == -FI_EAGAIN; i++)
		t = fi_trywait(P.fab, &f, 1);
	CHECK_EQ(t, 0);
	ct_fill(abuf, 700, 31);
	CHECK_EQ(fi_send(P.a.ep, abuf, 700, fi_mr_desc(amr), to_b, (void *)0xd2), 0);
	if (served)
		/* Nothing here progresses: the NIC's interrupt wakes the waiter. */
		CHECK_EQ(readable(fd, 10000), 1);
	double end = ct_now() + 30;
	while (fi_cntr_read(cntr) < 3 && ct_now() < end)
		if (try_block(&cntr->fid, fd) < 0)
			break;
	CHECK_EQ(fi_cntr_read(cntr), 3);
	CHECK(ct_same(bbuf, 700, 31));
	CHECK(ct_wait(P.a.cq, &e) && e.op_context == (void *)0xd2);
	CHECK(ct_wait(cq, &e) && e.op_context == (void *)0xd1);
	CHECK_EQ(fi_close(&eb->fid), 0);
	CHECK_EQ(fi_close(&cq->fid), 0);
	CHECK_EQ(fi_close(&cntr->fid), 0);
}

struct cm_entry {
	struct fi_eq_cm_entry e;
	char data[64];
};

/* The next event of `eq` (descriptor `fd`), waited for as the CQs are. */
static ssize_t eq_wait(struct fid_eq *eq, int fd, uint32_t *ev, struct cm_entry *c)
{
	double end = ct_now() + 30;
	ssize_t r;
	while ((r = fi_eq_read(eq, ev, c, sizeof(*c), 0)) == -FI_EAGAIN && ct_now() < end)
		if (try_block(&eq->fid, fd) < 0)
			break;
	return r;
}

/* Events the application writes (fi_eq_write) to event queue `eq` (descriptor `fd`):
 * read back as written, in order, and the descriptor readable while one waits. */
static void written_events(struct fid_eq *eq, int fd)
{
	struct fi_eq_entry in = {.fid = &P.fab->fid, .context = (void *)0x77, .data = 5}, out;
	uint32_t ev = 0;
	if (!served)
		CHECK_EQ(readable(fd, 0), 0);
	CHECK_EQ(fi_eq_write(eq, FI_NOTIFY, &in, sizeof(in), 0), sizeof(in));
	in.data = 6;
	CHECK_EQ(fi_eq_write(eq, FI_NOTIFY, &in, sizeof(in), 0), sizeof(in));
	CHECK_EQ(fi_eq_write(eq, FI_NOTIFY, NULL, 8, 0), -FI_EINVAL);
	CHECK_EQ(readable(fd, 0), 1);
	CHECK_EQ(fi_eq_read(eq, &ev, &out, 4, 0), -FI_ETOOSMALL);
	memset(&out, 0, sizeof(out));
	CHECK_EQ(fi_eq_read(eq, &ev, &out, sizeof(out), FI_PEEK), sizeof(out));
	CHECK_EQ(fi_eq_read(eq, &ev, &out, sizeof(out), 0), sizeof(out));
	CHECK_EQ(ev, FI_NOTIFY);
	CHECK(out.fid == &P.fab->fid && out.context == (void *)0x77 && out.data == 5);
	CHECK_EQ(fi_eq_sread(eq, &ev, &out, sizeof(out), 1000, 0), sizeof(out));
	CHECK_EQ(out.data, 6);
	if (!served)
		CHECK_EQ(readable(fd, 0), 0);
	CHECK_EQ(fi_eq_read(eq, &ev, &out, sizeof(out), 0), -FI_EAGAIN);
}

/* A connection between FI_EP_MSG endpoints whose event queues have descriptors. */
static void connection(void)
{
	struct fi_info *h = ct_hints(FI_MSG, 1), *list = NULL;
	h->ep_attr->type = FI_EP_MSG;
	REQUIRE(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &list) == 0);
	fi_freeinfo(h);
	REQUIRE(list && list->next);
	struct fi_eq_attr attr = {.size = 8, .wait_obj = FI_WAIT_FD};
	struct fid_eq *eqa = NULL, *eqb = NULL, *plain = NULL;
	REQUIRE(fi_eq_open(P.fab, &attr, &eqa, NULL) == 0);
	REQUIRE(fi_eq_open(P.fab, &attr, &eqb, NULL) == 0);
	enum fi_wait_obj w = FI_WAIT_NONE;
	CHECK_EQ(fi_control(&eqa->fid, FI_GETWAITOBJ, &w), 0);
	CHECK_EQ(w, FI_WAIT_FD);
	int fa = wait_fd(&eqa->fid), fb = wait_fd(&eqb->fid);
	written_events(eqa, fa);
	attr.wait_obj = FI_WAIT_UNSPEC;
	REQUIRE(fi_eq_open(P.fab, &attr, &plain, NULL) == 0);
	int fd = -7;
	CHECK_EQ(fi_control(&plain->fid, FI_GETWAIT, &fd), -FI_ENODATA);
	struct fid *pf = &plain->fid;
	CHECK_EQ(fi_trywait(P.fab, &pf, 1), -FI_EINVAL);
	CHECK_EQ(fi_close(&plain->fid), 0);

	struct fi_cq_attr cattr = {.format = FI_CQ_FORMAT_TAGGED, .size = 64};
	struct fid_cq *cqa = NULL, *cqb = NULL;
	REQUIRE(fi_cq_open(P.a.dom, &cattr, &cqa, NULL) == 0);
	REQUIRE(fi_cq_open(P.b.dom, &cattr, &cqb, NULL) == 0);
	struct fid_pep *pep = NULL;
	REQUIRE(fi_passive_ep(P.fab, list, &pep, NULL) == 0);
	REQUIRE(fi_pep_bind(pep, &eqa->fid, 0) == 0);
	REQUIRE(fi_listen(pep) == 0);
	char name[64];
	size_t len = sizeof(name);
	REQUIRE(fi_getname(&pep->fid, name, &len) == 0);
	struct fid_ep *b = NULL, *a = NULL;
	REQUIRE(fi_endpoint(P.b.dom, list->next, &b, NULL) == 0);
	REQUIRE(fi_ep_bind(b, &eqb->fid, 0) == 0);
	REQUIRE(fi_ep_bind(b, &cqb->fid, FI_TRANSMIT | FI_RECV) == 0);
	REQUIRE(fi_enable(b) == 0);
	static const char req[] = "knock";
	CHECK_EQ(fi_connect(b, name, req, sizeof(req)), 0);
	struct cm_entry c;
	uint32_t ev = 0;
	CHECK_EQ(eq_wait(eqa, fa, &ev, &c), sizeof(c.e) + sizeof(req));
	CHECK_EQ(ev, FI_CONNREQ);
	REQUIRE(c.e.info != NULL);
	REQUIRE(fi_endpoint(P.a.dom, c.e.info, &a, NULL) == 0);
	fi_freeinfo(c.e.info);
	REQUIRE(fi_ep_bind(a, &eqa->fid, 0) == 0);
	REQUIRE(fi_ep_bind(a, &cqa->fid, FI_TRANSMIT | FI_RECV) == 0);
	REQUIRE(fi_enable(a) == 0);
	CHECK_EQ(fi_accept(a, NULL, 0), 0);
	CHECK(eq_wait(eqb, fb, &ev, &c) >= (ssize_t)sizeof(c.e));
	CHECK_EQ(ev, FI_CONNECTED);
	CHECK(c.e.fid == &b->fid);
	CHECK(eq_wait(eqa, fa, &ev, &c) >= (ssize_t)sizeof(c.e));
	CHECK_EQ(ev, FI_CONNECTED);
	CHECK(c.e.fid == &a->fid);
	if (!served) {
		CHECK_EQ(readable(fa, 0), 0);
		CHECK_EQ(readable(fb, 0), 0);
	}
	CHECK_EQ(fi_shutdown(b, 0), 0);
	CHECK_EQ(eq_wait(eqa, fa, &ev, &c), sizeof(c.e));
	CHECK_EQ(ev, FI_SHUTDOWN);
	CHECK_EQ(fi_close(&a->fid), 0);
	CHECK_EQ(fi_close(&b->fid), 0);
	CHECK_EQ(fi_close(&pep->fid), 0);
	CHECK_EQ(fi_close(&cqa->fid), 0);
	CHECK_EQ(fi_close(&cqb->fid), 0);
	CHECK_EQ(fi_close(&eqa->fid), 0);
	CHECK_EQ(fi_close(&eqb->fid), 0);
	fi_freeinfo(list);
}

static struct fid_eq *mc_eq;

static void *eq_writer(void *arg)
{
	(void)arg;
	usleep(50000);
	struct fi_eq_entry in = {.fid = &mc_eq->fid, .context = (void *)0x77, .data = 42};
	CHECK_EQ(fi_eq_write(mc_eq, FI_NOTIFY, &in, sizeof(in), 0), sizeof(in));
	return NULL;
}

/* FI_WAIT_MUTEX_COND (fi_eq(3), fi_cq(3), fi_wait(3)): FI_GETWAIT gives the mutex and the
 * condition; a thread waiting on the condition (the mutex released in the wait) is woken
 * when another thread's fi_eq_write gives the queue an entry, long before its 10 s
 * timeout; fi_eq_sread and fi_cq_sread wait on such queues; a wait set of the kind opens. */
static void mutex_cond(void)
{
	struct fi_eq_attr ea = {.size = 8, .wait_obj = FI_WAIT_MUTEX_COND};
	REQUIRE(fi_eq_open(P.fab, &ea, &mc_eq, NULL) == 0);
	enum fi_wait_obj w = FI_WAIT_NONE;
	CHECK_EQ(fi_control(&mc_eq->fid, FI_GETWAITOBJ, &w), 0);
	CHECK_EQ(w, FI_WAIT_MUTEX_COND);
	CHECK_EQ(fi_control(&mc_eq->fid, FI_GETWAIT, NULL), -FI_EINVAL);
	struct fi_mutex_cond mc = {0};
	CHECK_EQ(fi_control(&mc_eq->fid, FI_GETWAIT, &mc), 0);
	REQUIRE(mc.mutex && mc.cond);

	uint32_t ev = 0;
	struct fi_eq_entry out = {0};
	CHECK_EQ(fi_eq_read(mc_eq, &ev, &out, sizeof(out), 0), -FI_EAGAIN);
	CHECK_EQ(pthread_mutex_lock(mc.mutex), 0);
	pthread_t th;
	REQUIRE(pthread_create(&th, NULL, eq_writer, NULL) == 0);
	struct timespec until;
	clock_gettime(CLOCK_REALTIME, &until);
	until.tv_sec += 10;
	double start = ct_now();
	int r = 0;
	ssize_t got;
	while ((got = fi_eq_read(mc_eq, &ev, &out, sizeof(out), 0)) == -FI_EAGAIN && r == 0)
		r = pthread_cond_timedwait(mc.cond, mc.mutex, &until);
	CHECK_EQ(pthread_mutex_unlock(mc.mutex), 0);
	CHECK_EQ(r, 0);
	CHECK(ct_now() - start < 5);
	CHECK_EQ(got, (ssize_t)sizeof(out));
	CHECK(ev == FI_NOTIFY && out.context == (void *)0x77 && out.data == 42);
	pthread_join(th, NULL);
	/* Empty: fi_eq_sread waits its timeout out. */
	CHECK_EQ(fi_eq_sread(mc_eq, &ev, &out, sizeof(out), 20, 0), -FI_EAGAIN);
	CHECK_EQ(fi_close(&mc_eq->fid), 0);

	struct fi_cq_attr ca = {.format = FI_CQ_FORMAT_CONTEXT, .wait_obj = FI_WAIT_MUTEX_COND};
	struct fid_cq *cq = NULL;
	REQUIRE(fi_cq_open(P.a.dom, &ca, &cq, NULL) == 0);
	struct fi_mutex_cond cmc = {0};
	CHECK_EQ(fi_control(&cq->fid, FI_GETWAIT, &cmc), 0);
	CHECK(cmc.mutex && cmc.cond && cmc.mutex != mc.mutex);
	struct fi_cq_entry ce;
	CHECK_EQ(fi_cq_sread(cq, &ce, 1, NULL, 20), -FI_EAGAIN);
	CHECK_EQ(fi_close(&cq->fid), 0);

	struct fi_wait_attr wa = {.wait_obj = FI_WAIT_MUTEX_COND};
	struct fid_wait *set = NULL;
	REQUIRE(fi_wait_open(P.fab, &wa, &set) == 0);
	CHECK_EQ(fi_control(&set->fid, FI_GETWAITOBJ, &w), 0);
	CHECK_EQ(w, FI_WAIT_MUTEX_COND);
	struct fi_mutex_cond smc = {0};
	CHECK_EQ(fi_control(&set->fid, FI_GETWAIT, &smc), 0);
	CHECK(smc.mutex && smc.cond);
	CHECK_EQ(fi_wait(set, 20), -FI_ETIMEDOUT);
	CHECK_EQ(fi_close(&set->fid), 0);
}

int main(int argc, char **argv)
{
	ct_name = "fdwait";
	served = argc > 1 && strcmp(argv[1], "served") == 0;
	struct ct_opts o = {.caps = FI_MSG, .mr_local = 1, .wait_obj = FI_WAIT_FD};
	ct_pair_open(&P, &o);
	ct_pair_bufs(&P, 1, BUFLEN, &abuf, &bbuf, &amr, &bmr);
	controls();
	idle();
	message(100, 1);
	message(BUFLEN, 2);
	readable_while_queued();
	woken_by_another_thread();
	if (served)
		interrupt_wakes();
	if (served)
		sread_sleeps();
	connection();
	wait_set();
	counter_waits();
	mutex_cond();
	/* In-process, fi_trywait said FI_SUCCESS only when nothing could come; served, every
	 * sleep ended in a wake-up (no block timed out). */
	CHECK_EQ(missed, 0);
	printf("fdwait: %d blocks\n", blocks);
	ct_pair_bufs_close(1, amr, bmr);
	ct_pair_close(&P);
	return ct_summary_exit();
}
