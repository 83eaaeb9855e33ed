/* sockaddr.c: the FI_SOCKADDR_IN address format (and FI_SOCKADDR, which gets it), as
 * programs written for the verbs and tcp providers ask for it: fi_getinfo with node and
 * service strings, fi_getname giving a struct sockaddr_in (the NIC's IPv4 address, the
 * service number as port: the application's, or an ephemeral port the provider claimed),
 * AVs of struct sockaddr_in (insert, lookup, straddr, FI_SYNC_ERR, addresses that name
 * nothing), messages between RDM and datagram endpoints named that way (by the NIC's
 * address and by this host's, 127.0.0.1), a connection between FI_EP_MSG endpoints to
 * 127.0.0.1:port, fi_setname, an endpoint taking a passive endpoint's address (hints and
 * info handle), and the refusals (another family, a short address, port 0, INADDR_ANY as
 * a destination, a service larger than a port).
 *
 * Usage: sockaddr [BASE]: BASE (default 47300) is the first of the service numbers of
 * the application's it uses.
 */
#include "ctest.h"

#include <arpa/inet.h>
#include <netinet/in.h>

static int base = 47300;
static char svc[5][16];

static struct fi_info *sa_hints(enum fi_ep_type type, uint32_t format)
{
	struct fi_info *h = ct_hints(FI_MSG, 1);
	h->ep_attr->type = type;
	h->addr_format = format;
	return h;
}

static struct sockaddr_in sin_of(const char *ip, int port)
{
	struct sockaddr_in s;
	memset(&s, 0, sizeof(s));
	s.sin_family = AF_INET;
	s.sin_port = htons((uint16_t)port);
	inet_pton(AF_INET, ip, &s.sin_addr);
	return s;
}

/* `a` is a struct sockaddr_in of `ip` (and `port` unless it is -1). */
static int is_sin(const void *a, size_t len, const char *ip, int port)
{
	struct sockaddr_in s, want = sin_of(ip, 0);
	if (len != sizeof(s) || !a)
		return 0;
	memcpy(&s, a, sizeof(s));
	return s.sin_family == AF_INET && s.sin_addr.s_addr == want.sin_addr.s_addr &&
	       (port < 0 || ntohs(s.sin_port) == port);
}

static int port_of(const void *a)
{
	struct sockaddr_in s;
	memcpy(&s, a, sizeof(s));
	return ntohs(s.sin_port);
}

static void getinfo(void)
{
	struct fi_info *h = sa_hints(FI_EP_RDM, FI_SOCKADDR_IN), *l = NULL;
	REQUIRE(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &l) == 0);
	REQUIRE(l && l->next);
	CHECK_EQ(l->addr_format, FI_SOCKADDR_IN);
	/* Each offer's source is its NIC's address, port 0 (no endpoint yet). */
	CHECK(is_sin(l->src_addr, l->src_addrlen, "10.0.0.1", 0));
	CHECK(is_sin(l->next->src_addr, l->next->src_addrlen, "10.0.0.2", 0));
	fi_freeinfo(l);

	/* FI_SOCKADDR: the provider picks the concrete format, struct sockaddr_in. */
	h->addr_format = FI_SOCKADDR;
	REQUIRE(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &l) == 0);
	CHECK_EQ(l->addr_format, FI_SOCKADDR_IN);
	CHECK(is_sin(l->src_addr, l->src_addrlen, "10.0.0.1", 0));
	fi_freeinfo(l);

	/* A peer's node and service make the destination; with FI_SOURCE, the service is the
	 * endpoint's own port. */
	h->addr_format = FI_SOCKADDR_IN;
	REQUIRE(fi_getinfo(CT_VERSION, "127.0.0.1", "9228", 0, h, &l) == 0);
	CHECK(is_sin(l->dest_addr, l->dest_addrlen, "127.0.0.1", 9228));
	fi_freeinfo(l);
	REQUIRE(fi_getinfo(CT_VERSION, NULL, "9229", FI_SOURCE, h, &l) == 0);
	CHECK(is_sin(l->src_addr, l->src_addrlen, "10.0.0.1", 9229));
	CHECK_EQ(l->dest_addr, NULL);
	fi_freeinfo(l);
	/* A NIC's own address with FI_SOURCE selects it. */
	REQUIRE(fi_getinfo(CT_VERSION, "10.0.0.2", "9230", FI_SOURCE, h, &l) == 0);
	CHECK(strcmp(l->domain_attr->name, "rb1") == 0);
	CHECK(is_sin(l->src_addr, l->src_addrlen, "10.0.0.2", 9230));
	fi_freeinfo(l);
	/* A source address in the hints selects its NIC; INADDR_ANY any NIC. (Its port does
	 * not reach the provider: libfabric 1.17's utility providers, asked first, zero it in
	 * the caller's hints.) */
	struct sockaddr_in src = sin_of("10.0.0.2", 0);
	h->src_addr = malloc(sizeof(src));
	memcpy(h->src_addr, &src, sizeof(src));
	h->src_addrlen = sizeof(src);
	REQUIRE(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &l) == 0);
	CHECK(l->next == NULL && strcmp(l->domain_attr->name, "rb1") == 0);
	CHECK(is_sin(l->src_addr, l->src_addrlen, "10.0.0.2", 0));
	fi_freeinfo(l);
	src = sin_of("0.0.0.0", 0);
	memcpy(h->src_addr, &src, sizeof(src));
	REQUIRE(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &l) == 0);
	CHECK(l->next != NULL);
	CHECK(is_sin(l->src_addr, l->src_addrlen, "10.0.0.1", 0));
	fi_freeinfo(l);
	free(h->src_addr);
	h->src_addr = NULL;
	h->src_addrlen = 0;

	/* A service number is a port: one larger is no such address (the provider says
	 * -FI_EINVAL, which libfabric reports as no data). */
	l = NULL;
	CHECK_EQ(fi_getinfo(CT_VERSION, "127.0.0.1", "70000", 0, h, &l), -FI_ENODATA);
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, "65536", FI_SOURCE, h, &l), -FI_ENODATA);
	CHECK(l == NULL);
	/* The provider's own format has none of that limit, and stays the default. */
	h->addr_format = FI_FORMAT_UNSPEC;
	REQUIRE(fi_getinfo(CT_VERSION, "127.0.0.1", "70000", 0, h, &l) == 0);
	CHECK(l->addr_format != FI_SOCKADDR_IN && l->addr_format != FI_FORMAT_UNSPEC);
	CHECK_EQ(l->dest_addrlen, 16);
	CHECK(l->dest_addr && ((unsigned char *)l->dest_addr)[0] == 'R');
	fi_freeinfo(l);
	/* Other socket formats: none. */
	h->addr_format = FI_SOCKADDR_IN6;
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &l), -FI_ENODATA);
	h->addr_format = FI_SOCKADDR_IB;
	CHECK_EQ(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &l), -FI_ENODATA);
	fi_freeinfo(h);
}

/* RDM endpoints on rb0 and rb1 named by struct sockaddr_in: names, AV, messages. */
static void rdm(struct fid_fabric *fab, struct fi_info *list, int dgram)
{
	struct ct_pair p;
	struct ct_opts o = {.caps = FI_MSG, .mr_local = 1};
	memset(&p, 0, sizeof(p));
	p.fab = fab;
	ct_side_open(&p, &p.a, list, &o);
	ct_side_open(&p, &p.b, list->next, &o);
	CHECK(is_sin(p.a.name, p.a.namelen, "10.0.0.1", -1));
	CHECK(is_sin(p.b.name, p.b.namelen, "10.0.0.2", -1));
	int pa = port_of(p.a.name), pb = port_of(p.b.name);
	/* The provider's ports: ephemeral ones, one per endpoint. */
	CHECK(pa >= 49152 && pa <= 65535);
	CHECK(pb >= 49152 && pb <= 65535);
	CHECK(pa != pb);
	/* A short buffer: -FI_ETOOSMALL and the length needed. */
	char small[8];
	size_t n = sizeof(small);
	CHECK_EQ(fi_getname(&p.a.ep->fid, small, &n), -FI_ETOOSMALL);
	CHECK_EQ(n, sizeof(struct sockaddr_in));

	/* The AV takes struct sockaddr_in, and gives them back. */
	REQUIRE(fi_av_insert(p.a.av, p.b.name, 1, &p.a.peer, 0, NULL) == 1);
	REQUIRE(fi_av_insert(p.b.av, p.a.name, 1, &p.b.peer, 0, NULL) == 1);
	struct sockaddr_in got;
	n = sizeof(got);
	CHECK_EQ(fi_av_lookup(p.a.av, p.a.peer, &got, &n), 0);
	CHECK_EQ(n, sizeof(got));
	CHECK(memcmp(&got, p.b.name, sizeof(got)) == 0);
	char str[64], want[64];
	n = sizeof(str);
	CHECK(fi_av_straddr(p.a.av, p.b.name, str, &n) == str);
	snprintf(want, sizeof(want), "fi_sockaddr_in://10.0.0.2:%d", pb);
	CHECK(strcmp(str, want) == 0);

	/* Addresses that name nothing: each fails alone, FI_ADDR_NOTAVAIL. */
	struct sockaddr_in bad[5];
	bad[0] = sin_of("10.0.0.2", pb);
	bad[0].sin_family = AF_INET6;
	bad[1] = sin_of("10.0.0.2", 0);
	bad[2] = sin_of("0.0.0.0", pb);
	memset(&bad[3], 0, sizeof(bad[3]));
	bad[4] = sin_of("10.0.0.2", pb);
	fi_addr_t fa[5];
	CHECK_EQ(fi_av_insert(p.a.av, bad, 5, fa, 0, NULL), 1);
	for (int i = 0; i < 4; i++)
		CHECK_EQ(fa[i], FI_ADDR_NOTAVAIL);
	CHECK(fa[4] != FI_ADDR_NOTAVAIL);
	/* FI_SYNC_ERR: each address's status in the context's ints. */
	int errs[2] = {-1, 0};
	CHECK_EQ(fi_av_insert(p.a.av, &bad[3], 2, NULL, FI_SYNC_ERR, errs), 1);
	CHECK_EQ(errs[0], FI_EINVAL);
	CHECK_EQ(errs[1], 0);

	/* Messages both ways, each naming the peer by its AV entry. */
	char *abuf = ct_pages(4096), *bbuf = ct_pages(4096);
	struct fid_mr *amr, *bmr;
	REQUIRE(fi_mr_reg(p.a.dom, abuf, 4096, FI_SEND | FI_RECV, 0, 0, 0, &amr, NULL) == 0);
	REQUIRE(fi_mr_reg(p.b.dom, bbuf, 4096, FI_SEND | FI_RECV, 0, 0, 0, &bmr, NULL) == 0);
	struct fi_cq_tagged_entry e;
	fi_addr_t from = 7;
	CHECK_EQ(fi_recv(p.b.ep, bbuf, 2048, fi_mr_desc(bmr), FI_ADDR_UNSPEC, (void *)0xb1), 0);
	ct_fill(abuf, 1000, 5);
	CHECK_EQ(fi_send(p.a.ep, abuf, 1000, fi_mr_desc(amr), p.a.peer, (void *)0xa1), 0);
	CHECK(ct_wait(p.a.cq, &e) && e.op_context == (void *)0xa1);
	CHECK(ct_read(p.b.cq, &e, &from, 30) == 1 && e.op_context == (void *)0xb1 &&
	      e.len == 1000);
	CHECK(ct_same(bbuf, 1000, 5));
	/* (A datagram's receive names its sender; an RDM endpoint's untagged one does not.) */
	if (dgram)
		CHECK_EQ(from, p.b.peer);
	CHECK_EQ(fi_recv(p.a.ep, abuf + 2048, 2048, fi_mr_desc(amr), FI_ADDR_UNSPEC,
			 (void *)0xa2),
		 0);
	ct_fill(bbuf + 2048, 700, 6);
	CHECK_EQ(fi_send(p.b.ep, bbuf + 2048, 700, fi_mr_desc(bmr), p.b.peer, (void *)0xb2), 0);
	CHECK(ct_wait(p.b.cq, &e) && e.op_context == (void *)0xb2);
	CHECK(ct_wait(p.a.cq, &e) && e.op_context == (void *)0xa2 && e.len == 700);
	CHECK(ct_same(abuf + 2048, 700, 6));

	/* An endpoint on a port of the application's (FI_SOURCE), reached through this host's
	 * address, 127.0.0.1, and that port. */
	struct fi_info *h = sa_hints(dgram ? FI_EP_DGRAM : FI_EP_RDM, FI_SOCKADDR_IN), *src = NULL;
	const char *s = svc[dgram ? 1 : 0];
	REQUIRE(fi_getinfo(CT_VERSION, NULL, s, FI_SOURCE, h, &src) == 0);
	fi_freeinfo(h);
	struct ct_side c;
	memset(&c, 0, sizeof(c));
	ct_side_open(&p, &c, src->next, &o);
	CHECK(is_sin(c.name, c.namelen, "10.0.0.2", atoi(s)));
	char *cbuf = ct_pages(4096);
	struct fid_mr *cmr;
	REQUIRE(fi_mr_reg(c.dom, cbuf, 4096, FI_SEND | FI_RECV, 0, 0, 0, &cmr, NULL) == 0);
	struct sockaddr_in host = sin_of("127.0.0.1", atoi(s));
	fi_addr_t to = FI_ADDR_NOTAVAIL;
	CHECK_EQ(fi_av_insert(p.a.av, &host, 1, &to, 0, NULL), 1);
	CHECK_EQ(fi_recv(c.ep, cbuf, 2048, fi_mr_desc(cmr), FI_ADDR_UNSPEC, (void *)0xc1), 0);
	ct_fill(abuf, 300, 7);
	CHECK_EQ(fi_send(p.a.ep, abuf, 300, fi_mr_desc(amr), to, (void *)0xa3), 0);
	CHECK(ct_wait(p.a.cq, &e) && e.op_context == (void *)0xa3);
	CHECK(ct_wait(c.cq, &e) && e.op_context == (void *)0xc1 && e.len == 300);
	CHECK(ct_same(cbuf, 300, 7));
	CHECK_EQ(fi_close(&cmr->fid), 0);
	ct_side_close(&c);
	fi_freeinfo(src);

	CHECK_EQ(fi_close(&amr->fid), 0);
	CHECK_EQ(fi_close(&bmr->fid), 0);
	ct_side_close(&p.a);
	ct_side_close(&p.b);
}

struct cm_entry {
	struct fi_eq_cm_entry e;
	char data[64];
};

static ssize_t next_event(struct fid_eq *eq, uint32_t *event, struct cm_entry *c)
{
	memset(c, 0, sizeof(*c));
	return fi_eq_sread(eq, event, c, sizeof(*c), 10000, 0);
}

/* Connected endpoints: a passive endpoint on rb0 listening on a port of the
 * application's, an endpoint on rb1 connecting to 127.0.0.1 and that port. */
static void msg(struct fid_fabric *fab)
{
	struct fi_info *h = sa_hints(FI_EP_MSG, FI_SOCKADDR), *src = NULL, *dst = NULL;
	REQUIRE(fi_getinfo(CT_VERSION, NULL, svc[2], FI_SOURCE, h, &src) == 0);
	REQUIRE(fi_getinfo(CT_VERSION, "127.0.0.1", svc[2], 0, h, &dst) == 0);
	REQUIRE(src && dst && dst->next);
	CHECK(is_sin(dst->dest_addr, dst->dest_addrlen, "127.0.0.1", atoi(svc[2])));
	struct fi_eq_attr eqattr = {.size = 16, .wait_obj = FI_WAIT_UNSPEC};
	struct fi_cq_attr cqattr = {.format = FI_CQ_FORMAT_TAGGED, .size = 64};
	struct fid_eq *eqa, *eqb;
	struct fid_domain *da, *db;
	struct fid_cq *cqa, *cqb;
	REQUIRE(fi_eq_open(fab, &eqattr, &eqa, NULL) == 0);
	REQUIRE(fi_eq_open(fab, &eqattr, &eqb, NULL) == 0);
	REQUIRE(fi_domain(fab, src, &da, NULL) == 0);
	REQUIRE(fi_domain(fab, dst->next, &db, NULL) == 0);
	REQUIRE(fi_cq_open(da, &cqattr, &cqa, NULL) == 0);
	REQUIRE(fi_cq_open(db, &cqattr, &cqb, NULL) == 0);

	struct fid_pep *pep;
	REQUIRE(fi_passive_ep(fab, src, &pep, NULL) == 0);
	REQUIRE(fi_pep_bind(pep, &eqa->fid, 0) == 0);
	REQUIRE(fi_listen(pep) == 0);
	struct sockaddr_in pname;
	size_t n = sizeof(pname);
	CHECK_EQ(fi_getname(&pep->fid, &pname, &n), 0);
	CHECK(is_sin(&pname, n, "10.0.0.1", atoi(svc[2])));
	/* Listening: its address cannot change any more. */
	struct sockaddr_in other = sin_of("127.0.0.1", atoi(svc[3]));
	CHECK_EQ(fi_setname(&pep->fid, &other, sizeof(other)), -FI_EOPBADSTATE);

	/* Refused destinations: another family, port 0, INADDR_ANY. */
	struct fid_ep *b = ct_ep_open(db, dst->next, &eqb->fid, cqb);
	struct sockaddr_in bad = sin_of("127.0.0.1", atoi(svc[2]));
	bad.sin_family = AF_INET6;
	CHECK_EQ(fi_connect(b, &bad, NULL, 0), -FI_EINVAL);
	bad = sin_of("127.0.0.1", 0);
	CHECK_EQ(fi_connect(b, &bad, NULL, 0), -FI_EINVAL);
	bad = sin_of("0.0.0.0", atoi(svc[2]));
	CHECK_EQ(fi_connect(b, &bad, NULL, 0), -FI_EINVAL);

	static const char req[] = "sockaddr";
	CHECK_EQ(fi_connect(b, dst->dest_addr, req, sizeof(req)), 0);
	struct cm_entry c;
	uint32_t ev = 0;
	REQUIRE(next_event(eqa, &ev, &c) == (ssize_t)(sizeof(c.e) + sizeof(req)));
	CHECK_EQ(ev, FI_CONNREQ);
	REQUIRE(c.e.info != NULL);
	CHECK_EQ(c.e.info->addr_format, FI_SOCKADDR_IN);
	struct fid_ep *a = ct_ep_open(da, c.e.info, &eqa->fid, cqa);
	fi_freeinfo(c.e.info);
	CHECK_EQ(fi_accept(a, NULL, 0), 0);
	CHECK(next_event(eqb, &ev, &c) >= (ssize_t)sizeof(c.e));
	CHECK_EQ(ev, FI_CONNECTED);
	CHECK(next_event(eqa, &ev, &c) >= (ssize_t)sizeof(c.e));
	CHECK_EQ(ev, FI_CONNECTED);
	/* The endpoint that accepted has its listener's address, as an accepted socket. */
	struct sockaddr_in aname;
	n = sizeof(aname);
	CHECK_EQ(fi_getname(&a->fid, &aname, &n), 0);
	CHECK(n == sizeof(aname) && memcmp(&aname, &pname, sizeof(aname)) == 0);
	struct sockaddr_in bname;
	n = sizeof(bname);
	CHECK_EQ(fi_getname(&b->fid, &bname, &n), 0);
	CHECK(is_sin(&bname, n, "10.0.0.2", -1));

	char *abuf = ct_pages(4096), *bbuf = ct_pages(4096);
	struct fi_cq_tagged_entry e;
	CHECK_EQ(fi_recv(a, abuf, 4096, NULL, 0, (void *)0xa1), 0);
	ct_fill(bbuf, 2000, 9);
	CHECK_EQ(fi_send(b, bbuf, 2000, NULL, 0, (void *)0xb1), 0);
	CHECK(ct_wait(cqb, &e) && e.op_context == (void *)0xb1);
	CHECK(ct_wait(cqa, &e) && e.op_context == (void *)0xa1 && e.len == 2000);
	CHECK(ct_same(abuf, 2000, 9));

	CHECK_EQ(fi_shutdown(b, 0), 0);
	CHECK_EQ(fi_close(&a->fid), 0);
	CHECK_EQ(fi_close(&b->fid), 0);
	CHECK_EQ(fi_close(&pep->fid), 0);

	/* fi_setname of a passive endpoint (a socket's bind), then an endpoint that takes its
	 * address (hints and info handle), as fabtests' fi_msg_sockets does. */
	REQUIRE(fi_passive_ep(fab, dst->next, &pep, NULL) == 0);
	n = sizeof(pname);
	CHECK_EQ(fi_getname(&pep->fid, &pname, &n), 0);
	CHECK(is_sin(&pname, n, "10.0.0.2", -1));
	CHECK(port_of(&pname) >= 49152);
	CHECK_EQ(fi_setname(&pep->fid, &other, 8), -FI_EINVAL);
	struct sockaddr_in nic0 = sin_of("10.0.0.1", atoi(svc[3]));
	CHECK_EQ(fi_setname(&pep->fid, &nic0, sizeof(nic0)), -FI_EADDRNOTAVAIL);
	CHECK_EQ(fi_setname(&pep->fid, &other, sizeof(other)), 0);
	n = sizeof(pname);
	CHECK_EQ(fi_getname(&pep->fid, &pname, &n), 0);
	CHECK(is_sin(&pname, n, "10.0.0.2", atoi(svc[3])));
	h->handle = &pep->fid;
	struct fi_info *hl = NULL;
	REQUIRE(fi_getinfo(CT_VERSION, "127.0.0.1", svc[2], 0, h, &hl) == 0);
	h->handle = NULL;
	CHECK(hl->handle == &pep->fid);
	CHECK(strcmp(hl->domain_attr->name, "rb1") == 0);
	struct fid_ep *t = ct_ep_open(db, hl, &eqb->fid, cqb);
	CHECK_EQ(fi_close(&pep->fid), 0);
	n = sizeof(bname);
	CHECK_EQ(fi_getname(&t->fid, &bname, &n), 0);
	CHECK(n == sizeof(bname) && memcmp(&bname, &pname, sizeof(bname)) == 0);
	CHECK_EQ(fi_close(&t->fid), 0);
	fi_freeinfo(hl);

	CHECK_EQ(fi_close(&cqa->fid), 0);
	CHECK_EQ(fi_close(&cqb->fid), 0);
	CHECK_EQ(fi_close(&da->fid), 0);
	CHECK_EQ(fi_close(&db->fid), 0);
	CHECK_EQ(fi_close(&eqa->fid), 0);
	CHECK_EQ(fi_close(&eqb->fid), 0);
	fi_freeinfo(src);
	fi_freeinfo(dst);
	fi_freeinfo(h);
}

int main(int argc, char **argv)
{
	ct_name = "sockaddr";
	if (argc > 1)
		base = atoi(argv[1]);
	for (int i = 0; i < 5; i++)
		snprintf(svc[i], sizeof(svc[i]), "%d", base + i);
	getinfo();
	struct fi_info *h = sa_hints(FI_EP_RDM, FI_SOCKADDR_IN), *rdm_list = NULL, *dg = NULL;
	REQUIRE(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &rdm_list) == 0);
	h->ep_attr->type = FI_EP_DGRAM;
	REQUIRE(fi_getinfo(CT_VERSION, NULL, NULL, 0, h, &dg) == 0);
	fi_freeinfo(h);
	struct fid_fabric *fab;
	REQUIRE(fi_fabric(rdm_list->fabric_attr, &fab, NULL) == 0);
	rdm(fab, rdm_list, 0);
	rdm(fab, dg, 1);
	msg(fab);
	CHECK_EQ(fi_close(&fab->fid), 0);
	fi_freeinfo(rdm_list);
	fi_freeinfo(dg);
	return ct_summary_exit();
}
