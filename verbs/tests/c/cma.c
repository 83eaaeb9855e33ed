/* RDMA-CM (librdmacm's rdma_* calls) on ringbell NICs, in one process over the in-process
 * fabric's two NICs (rb0 10.0.0.1, rb1 10.0.0.2): address and route resolution, listen,
 * connect with private data, accept, data over the connected QPs, disconnect, reject, a
 * port nobody listens on, a connection within one NIC, the synchronous calls
 * (rdma_create_ep, rdma_get_request) with a server thread, datagram ids (service id
 * resolution) and their multicast groups, and the refusals. Linked with -lrdmacm; the library answers every rdma_*
 * call. */
#include "common.h"
#include <signal.h>
#include <poll.h>
#include <pthread.h>
#include <rdma/rdma_cma.h>
#include <rdma/rdma_verbs.h>

/* The next event of `ch`, which must be of kind `want`. */
static struct rdma_cm_event *expect_event(struct rdma_event_channel *ch,
					  enum rdma_cm_event_type want)
{
	struct rdma_cm_event *e = NULL;
	CHECK_OK(rdma_get_cm_event(ch, &e));
	CHECK(e != NULL);
	if (e->event != want)
		FAIL("event %s (status %d), want %s", rdma_event_str(e->event), e->status,
		     rdma_event_str(want));
	return e;
}

static enum ibv_qp_state qp_state(struct ibv_qp *qp)
{
	struct ibv_qp_attr a;
	struct ibv_qp_init_attr ia;
	CHECK_OK(ibv_query_qp(qp, &a, IBV_QP_STATE, &ia));
	return a.qp_state;
}

static struct ibv_qp_init_attr rc_attr(void)
{
	struct ibv_qp_init_attr a;
	memset(&a, 0, sizeof a);
	a.qp_type = IBV_QPT_RC;
	a.cap.max_send_wr = a.cap.max_recv_wr = 8;
	a.cap.max_send_sge = a.cap.max_recv_sge = 1;
	a.cap.max_inline_data = 32;
	return a;
}

static uint16_t port_of(struct sockaddr *sa)
{
	return ntohs(((struct sockaddr_in *)sa)->sin_port);
}

static uint32_t ip_of(struct sockaddr *sa)
{
	return ntohl(((struct sockaddr_in *)sa)->sin_addr.s_addr);
}

/* An id on `ch` of port space `ps` resolved from `src_ip` (any NIC when "0.0.0.0") to
 * `dst_ip`:`port`, with a QP of `qp_type` (in INIT for RC, ready for UD). */
static struct rdma_cm_id *resolved(struct rdma_event_channel *ch, enum rdma_port_space ps,
				   const char *src_ip, const char *dst_ip, int port,
				   enum ibv_qp_type qp_type)
{
	struct rdma_cm_id *id;
	CHECK_OK(rdma_create_id(ch, &id, NULL, ps));
	struct sockaddr_in src = sin_of(src_ip, 0), dst = sin_of(dst_ip, port);
	CHECK_OK(rdma_resolve_addr(id, (struct sockaddr *)&src, (struct sockaddr *)&dst, 1000));
	CHECK_OK(rdma_ack_cm_event(expect_event(ch, RDMA_CM_EVENT_ADDR_RESOLVED)));
	CHECK_OK(rdma_resolve_route(id, 1000));
	CHECK_OK(rdma_ack_cm_event(expect_event(ch, RDMA_CM_EVENT_ROUTE_RESOLVED)));
	struct ibv_qp_init_attr a = rc_attr();
	a.qp_type = qp_type;
	CHECK_OK(rdma_create_qp(id, NULL, &a));
	return id;
}

/* A connection from `src_ip` to the listener `lid` (on channel `sch`, port `port`):
 * both ids established, with QPs in RTS. */
struct conn {
	struct rdma_cm_id *cli, *srv;
};

static struct conn connect_pair(struct rdma_event_channel *cch, struct rdma_event_channel *sch,
				struct rdma_cm_id *lid, const char *src_ip, const char *dst_ip,
				int port)
{
	struct conn c;
	struct rdma_cm_event *e;
	c.cli = resolved(cch, RDMA_PS_TCP, src_ip, dst_ip, port, IBV_QPT_RC);
	CHECK_OK(rdma_connect(c.cli, NULL));
	e = expect_event(sch, RDMA_CM_EVENT_CONNECT_REQUEST);
	CHECK(e->listen_id == lid);
	c.srv = e->id;
	CHECK_OK(rdma_ack_cm_event(e));
	struct ibv_qp_init_attr a = rc_attr();
	CHECK_OK(rdma_create_qp(c.srv, NULL, &a));
	CHECK_OK(rdma_accept(c.srv, NULL));
	CHECK_OK(rdma_ack_cm_event(expect_event(cch, RDMA_CM_EVENT_ESTABLISHED)));
	CHECK_OK(rdma_ack_cm_event(expect_event(sch, RDMA_CM_EVENT_ESTABLISHED)));
	CHECK_EQ(qp_state(c.cli->qp), IBV_QPS_RTS);
	CHECK_EQ(qp_state(c.srv->qp), IBV_QPS_RTS);
	return c;
}

/* Disconnects from the client's side: both ids see DISCONNECTED, both QPs are in ERR. */
static void close_pair(struct rdma_event_channel *cch, struct rdma_event_channel *sch,
		       struct conn *c)
{
	CHECK_OK(rdma_disconnect(c->cli));
	CHECK_EQ(qp_state(c->cli->qp), IBV_QPS_ERR);
	CHECK_OK(rdma_ack_cm_event(expect_event(sch, RDMA_CM_EVENT_DISCONNECTED)));
	CHECK_OK(rdma_ack_cm_event(expect_event(cch, RDMA_CM_EVENT_DISCONNECTED)));
	CHECK_EQ(qp_state(c->srv->qp), IBV_QPS_ERR);
	/* A disconnect after the connection closed answers 0, as the kernel's does (it
	 * answers a disconnect already under way), and leaves the QP in ERR. */
	CHECK_OK(rdma_disconnect(c->cli));
	CHECK_OK(rdma_disconnect(c->srv));
	CHECK_EQ(qp_state(c->cli->qp), IBV_QPS_ERR);
	rdma_destroy_qp(c->cli);
	rdma_destroy_qp(c->srv);
	CHECK(c->cli->qp == NULL);
	CHECK_OK(rdma_destroy_id(c->cli));
	CHECK_OK(rdma_destroy_id(c->srv));
}

/* ---- datagram ids (RDMA_PS_UDP): service id resolution ---- */

/* A datagram id on `ch` from rb1 to 10.0.0.1:`port`, resolved, with a UD QP. */
static struct rdma_cm_id *ud_client(struct rdma_event_channel *ch, int port)
{
	struct rdma_cm_id *id = resolved(ch, RDMA_PS_UDP, "10.0.0.2", "10.0.0.1", port, IBV_QPT_UD);
	CHECK_EQ(id->qp_type, IBV_QPT_UD);
	/* Ready at once, with librdmacm's Q_Key. */
	struct ibv_qp_attr qa;
	struct ibv_qp_init_attr qia;
	CHECK_OK(ibv_query_qp(id->qp, &qa, IBV_QP_STATE | IBV_QP_QKEY, &qia));
	CHECK_EQ(qa.qp_state, IBV_QPS_RTS);
	CHECK_EQ(qa.qkey, RDMA_UDP_QKEY);
	return id;
}

static void datagrams(struct rdma_event_channel *sch, struct rdma_event_channel *cch)
{
	struct rdma_cm_event *e;
	struct rdma_cm_id *lid;
	CHECK_OK(rdma_create_id(sch, &lid, NULL, RDMA_PS_UDP));
	struct sockaddr_in laddr = sin_of("10.0.0.1", 7473);
	CHECK_OK(rdma_bind_addr(lid, (struct sockaddr *)&laddr));
	CHECK_OK(rdma_listen(lid, 4));

	struct rdma_cm_id *cli = ud_client(cch, 7473);
	{
		struct rdma_cm_id *u;
		CHECK_OK(rdma_create_id(cch, &u, NULL, RDMA_PS_UDP));
		CHECK_OK(rdma_resolve_addr(u, NULL, (struct sockaddr *)&laddr, 1000));
		CHECK_OK(rdma_ack_cm_event(expect_event(cch, RDMA_CM_EVENT_ADDR_RESOLVED)));
		struct ibv_qp_init_attr ra = rc_attr();
		errno = 0;
		CHECK_EQ(rdma_create_qp(u, NULL, &ra), -1); /* an RC QP on a datagram id */
		CHECK_EQ(errno, EINVAL);
		CHECK_OK(rdma_destroy_id(u));
	}
	struct rdma_conn_param p;
	memset(&p, 0, sizeof p);
	char big[200];
	memset(big, 'y', sizeof big);
	p.private_data = big;
	p.private_data_len = 181; /* a datagram request carries 180 */
	errno = 0;
	CHECK_EQ(rdma_connect(cli, &p), -1);
	CHECK_EQ(errno, EINVAL);
	p.private_data = "which qp?";
	p.private_data_len = 10;
	CHECK_OK(rdma_connect(cli, &p));
	e = expect_event(sch, RDMA_CM_EVENT_CONNECT_REQUEST);
	CHECK(e->listen_id == lid);
	struct rdma_cm_id *srv = e->id;
	CHECK_EQ(srv->ps, RDMA_PS_UDP);
	CHECK_EQ(e->param.ud.private_data_len, 180);
	CHECK_MEM(e->param.ud.private_data, "which qp?", 10);
	CHECK_OK(rdma_ack_cm_event(e));
	struct ibv_qp_init_attr a = rc_attr();
	a.qp_type = IBV_QPT_UD;
	CHECK_OK(rdma_create_qp(srv, NULL, &a));
	uint8_t *sbuf = calloc(1, 4096);
	struct ibv_mr *smr = ibv_reg_mr(srv->pd, sbuf, 4096, IBV_ACCESS_LOCAL_WRITE);
	CHECK(smr != NULL);
	CHECK_OK(rdma_post_recv(srv, (void *)7, sbuf, 40 + 64, smr));
	memset(&p, 0, sizeof p);
	p.private_data = "this one";
	p.private_data_len = 9;
	CHECK_OK(rdma_accept(srv, &p));

	e = expect_event(cch, RDMA_CM_EVENT_ESTABLISHED);
	CHECK(e->id == cli);
	CHECK_EQ(e->param.ud.qp_num, srv->qp->qp_num);
	CHECK_EQ(e->param.ud.qkey, RDMA_UDP_QKEY);
	CHECK_EQ(e->param.ud.private_data_len, 136);
	CHECK_MEM(e->param.ud.private_data, "this one", 9);
	CHECK(e->param.ud.ah_attr.is_global);
	union ibv_gid want = gid_of(srv->verbs);
	CHECK_MEM(&e->param.ud.ah_attr.grh.dgid, &want, 16);
	struct ibv_ah *ah = ibv_create_ah(cli->pd, &e->param.ud.ah_attr);
	CHECK(ah != NULL);
	uint32_t rqpn = e->param.ud.qp_num, rqkey = e->param.ud.qkey;
	CHECK_OK(rdma_ack_cm_event(e));

	/* A datagram to the QP the reply named. */
	uint8_t *cbuf = calloc(1, 4096);
	struct ibv_mr *cmr = ibv_reg_mr(cli->pd, cbuf, 4096, IBV_ACCESS_LOCAL_WRITE);
	CHECK(cmr != NULL);
	memcpy(cbuf, "a datagram", 11);
	CHECK_OK(rdma_post_ud_send(cli, (void *)8, cbuf, 11, cmr, IBV_SEND_SIGNALED, ah, rqpn));
	(void)rqkey;
	struct ibv_wc wc;
	EXPECT_WC(cli->send_cq, &wc, IBV_WC_SUCCESS, IBV_WC_SEND);
	EXPECT_WC(srv->recv_cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
	CHECK_EQ(wc.byte_len, 40 + 11);
	CHECK_EQ(wc.src_qp, cli->qp->qp_num);
	CHECK_MEM(sbuf + 40, "a datagram", 11);
	CHECK_OK(ibv_destroy_ah(ah));

	/* A refused request: unreachable, status 2 (rejected by the service provider). */
	struct rdma_cm_id *r = ud_client(cch, 7473);
	CHECK_OK(rdma_connect(r, NULL));
	e = expect_event(sch, RDMA_CM_EVENT_CONNECT_REQUEST);
	struct rdma_cm_id *rs = e->id;
	CHECK_OK(rdma_ack_cm_event(e));
	CHECK_OK(rdma_reject(rs, "no", 3));
	e = expect_event(cch, RDMA_CM_EVENT_UNREACHABLE);
	CHECK_EQ(e->status, 2);
	CHECK_OK(rdma_ack_cm_event(e));
	CHECK_OK(rdma_destroy_id(rs));
	rdma_destroy_qp(r);
	CHECK_OK(rdma_destroy_id(r));

	/* Nobody on the port: unreachable, status 1 (service id not supported). */
	r = ud_client(cch, 7998);
	CHECK_OK(rdma_connect(r, NULL));
	e = expect_event(cch, RDMA_CM_EVENT_UNREACHABLE);
	CHECK_EQ(e->status, 1);
	CHECK_OK(rdma_ack_cm_event(e));
	rdma_destroy_qp(r);
	CHECK_OK(rdma_destroy_id(r));

	CHECK_OK(ibv_dereg_mr(cmr));
	CHECK_OK(ibv_dereg_mr(smr));
	free(cbuf);
	free(sbuf);
	rdma_destroy_qp(cli);
	rdma_destroy_qp(srv);
	CHECK_OK(rdma_destroy_id(cli));
	CHECK_OK(rdma_destroy_id(srv));
	CHECK_OK(rdma_destroy_id(lid));
}

/* A datagram id on `ch` bound to `ip` that joined `group` (its MULTICAST_JOIN checked). */
static struct rdma_cm_id *member(struct rdma_event_channel *ch, const char *ip, const char *group,
				 struct ibv_ah_attr *ah, uint32_t *qpn, uint32_t *qkey)
{
	struct rdma_cm_id *id;
	CHECK_OK(rdma_create_id(ch, &id, NULL, RDMA_PS_UDP));
	struct sockaddr_in src = sin_of(ip, 0), g = sin_of(group, 0);
	CHECK_OK(rdma_resolve_addr(id, (struct sockaddr *)&src, (struct sockaddr *)&g, 1000));
	CHECK_OK(rdma_ack_cm_event(expect_event(ch, RDMA_CM_EVENT_ADDR_RESOLVED)));
	struct ibv_qp_init_attr a = rc_attr();
	a.qp_type = IBV_QPT_UD;
	CHECK_OK(rdma_create_qp(id, NULL, &a));
	CHECK_OK(rdma_join_multicast(id, (struct sockaddr *)&g, (void *)0x901));
	struct rdma_cm_event *e = expect_event(ch, RDMA_CM_EVENT_MULTICAST_JOIN);
	CHECK(e->id == id);
	/* The join's context comes back in private_data, as librdmacm gives it. */
	CHECK(e->param.ud.private_data == (void *)0x901);
	CHECK_EQ(e->param.ud.qp_num, 0xFFFFFF);
	CHECK_EQ(e->param.ud.qkey, RDMA_UDP_QKEY);
	CHECK_EQ(e->param.ud.ah_attr.grh.dgid.raw[12], 224);
	*ah = e->param.ud.ah_attr;
	*qpn = e->param.ud.qp_num;
	*qkey = e->param.ud.qkey;
	CHECK_OK(rdma_ack_cm_event(e));
	errno = 0;
	CHECK_EQ(rdma_join_multicast(id, (struct sockaddr *)&g, NULL), -1); /* joined once */
	CHECK_EQ(errno, EADDRINUSE);
	return id;
}

static void multicast(struct rdma_event_channel *ch)
{
	struct ibv_ah_attr ah;
	uint32_t qpn, qkey;
	struct rdma_cm_id *rx = member(ch, "10.0.0.1", "224.0.0.7", &ah, &qpn, &qkey);
	struct rdma_cm_id *tx = member(ch, "10.0.0.2", "224.0.0.7", &ah, &qpn, &qkey);
	uint8_t *rbuf = calloc(1, 4096), *tbuf = calloc(1, 4096);
	struct ibv_mr *rmr = ibv_reg_mr(rx->pd, rbuf, 4096, IBV_ACCESS_LOCAL_WRITE);
	struct ibv_mr *tmr = ibv_reg_mr(tx->pd, tbuf, 4096, IBV_ACCESS_LOCAL_WRITE);
	CHECK(rmr && tmr);
	CHECK_OK(rdma_post_recv(rx, (void *)1, rbuf, 40 + 64, rmr));
	struct ibv_ah *gah = ibv_create_ah(tx->pd, &ah);
	CHECK(gah != NULL);
	memcpy(tbuf, "to the group", 13);
	CHECK_OK(rdma_post_ud_send(tx, (void *)2, tbuf, 13, tmr, IBV_SEND_SIGNALED, gah, qpn));
	struct ibv_wc wc;
	EXPECT_WC(tx->send_cq, &wc, IBV_WC_SUCCESS, IBV_WC_SEND);
	EXPECT_WC(rx->recv_cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
	CHECK_MEM(rbuf + 40, "to the group", 13);
	/* Refusals: a group on a connected id, a unicast address, a send-only join. */
	struct rdma_cm_id *tcp;
	CHECK_OK(rdma_create_id(ch, &tcp, NULL, RDMA_PS_TCP));
	struct sockaddr_in g = sin_of("224.0.0.7", 0), uni = sin_of("10.0.0.1", 0);
	errno = 0;
	CHECK_EQ(rdma_join_multicast(tcp, (struct sockaddr *)&g, NULL), -1);
	CHECK_EQ(errno, EINVAL);
	CHECK_OK(rdma_destroy_id(tcp));
	struct sockaddr_in g2 = sin_of("224.0.0.8", 0);
	errno = 0;
	CHECK_EQ(rdma_join_multicast(rx, (struct sockaddr *)&uni, NULL), -1);
	CHECK_EQ(errno, EINVAL);
	struct rdma_cm_join_mc_attr_ex x = {
		.comp_mask = RDMA_CM_JOIN_MC_ATTR_ADDRESS | RDMA_CM_JOIN_MC_ATTR_JOIN_FLAGS,
		.join_flags = RDMA_MC_JOIN_FLAG_SENDONLY_FULLMEMBER,
		.addr = (struct sockaddr *)&g2,
	};
	errno = 0;
	CHECK_EQ(rdma_join_multicast_ex(rx, &x, NULL), -1);
	CHECK_EQ(errno, EOPNOTSUPP);
	/* Left, the group no longer reaches the QP. */
	CHECK_OK(rdma_leave_multicast(rx, (struct sockaddr *)&g));
	errno = 0;
	CHECK_EQ(rdma_leave_multicast(rx, (struct sockaddr *)&g), -1);
	CHECK_EQ(errno, EADDRNOTAVAIL);
	CHECK_OK(rdma_post_ud_send(tx, (void *)3, tbuf, 13, tmr, IBV_SEND_SIGNALED, gah, qpn));
	EXPECT_WC(tx->send_cq, &wc, IBV_WC_SUCCESS, IBV_WC_SEND);
	EXPECT_NO_WC(rx->recv_cq, 2000);
	CHECK_OK(ibv_destroy_ah(gah));
	CHECK_OK(ibv_dereg_mr(rmr));
	CHECK_OK(ibv_dereg_mr(tmr));
	free(rbuf);
	free(tbuf);
	/* An id destroyed in its group leaves it with its QP. */
	rdma_destroy_qp(rx);
	rdma_destroy_qp(tx);
	CHECK_OK(rdma_destroy_id(rx));
	CHECK_OK(rdma_destroy_id(tx));
}

/* ---- the synchronous calls, as rdma_server and rdma_client use them ---- */

static void *sync_server(void *arg)
{
	(void)arg;
	struct rdma_addrinfo hints, *res;
	memset(&hints, 0, sizeof hints);
	hints.ai_flags = RAI_PASSIVE;
	hints.ai_port_space = RDMA_PS_TCP;
	CHECK_OK(rdma_getaddrinfo("10.0.0.1", "7472", &hints, &res));
	struct ibv_qp_init_attr a = rc_attr();
	a.sq_sig_all = 1;
	struct rdma_cm_id *lid, *id;
	CHECK_OK(rdma_create_ep(&lid, res, NULL, &a));
	rdma_freeaddrinfo(res);
	CHECK_OK(rdma_listen(lid, 1));
	CHECK_OK(rdma_get_request(lid, &id));
	/* The request's QP was made from the listening endpoint's attributes. */
	CHECK(id->qp != NULL && id->pd != NULL && id->recv_cq != NULL);
	CHECK(id->event != NULL && id->event->event == RDMA_CM_EVENT_CONNECT_REQUEST);
	char buf[16];
	struct ibv_mr *mr = rdma_reg_msgs(id, buf, sizeof buf);
	CHECK(mr != NULL);
	CHECK_OK(rdma_post_recv(id, NULL, buf, sizeof buf, mr));
	CHECK_OK(rdma_accept(id, NULL));
	struct ibv_wc wc;
	CHECK_EQ(rdma_get_recv_comp(id, &wc), 1);
	CHECK_EQ(wc.status, IBV_WC_SUCCESS);
	CHECK_MEM(buf, "sync-request!!!", 16);
	memcpy(buf, "sync-reply!!!!!", 16);
	CHECK_OK(rdma_post_send(id, NULL, buf, sizeof buf, mr, 0));
	CHECK_EQ(rdma_get_send_comp(id, &wc), 1);
	CHECK_EQ(wc.status, IBV_WC_SUCCESS);
	/* The client disconnects; its DREQ is answered whether or not this side waits. */
	rdma_disconnect(id);
	CHECK_OK(rdma_dereg_mr(mr));
	rdma_destroy_ep(id);
	rdma_destroy_ep(lid);
	return NULL;
}

static void sync_client(void)
{
	pthread_t t;
	CHECK_OK(pthread_create(&t, NULL, sync_server, NULL));
	struct rdma_addrinfo hints, *res;
	memset(&hints, 0, sizeof hints);
	hints.ai_port_space = RDMA_PS_TCP;
	CHECK_OK(rdma_getaddrinfo("10.0.0.1", "7472", &hints, &res));
	CHECK(res->ai_dst_addr != NULL && res->ai_src_addr == NULL);
	CHECK_EQ(port_of(res->ai_dst_addr), 7472);
	struct rdma_cm_id *id = NULL;
	/* The server thread may not listen yet: a refused request is tried again. */
	double end = now_s() + WAIT_S;
	for (;;) {
		/* (rdma_create_ep writes the CQs it made into the attributes.) */
		struct ibv_qp_init_attr a = rc_attr();
		a.sq_sig_all = 1;
		a.qp_type = 0; /* rdma_create_ep takes the address information's (RC) */
		CHECK_OK(rdma_create_ep(&id, res, NULL, &a));
		CHECK(a.send_cq == id->send_cq && a.qp_type == IBV_QPT_RC);
		CHECK(id->qp != NULL && id->send_cq != NULL && id->send_cq_channel != NULL);
		char buf[16];
		struct ibv_mr *mr = rdma_reg_msgs(id, buf, sizeof buf);
		CHECK(mr != NULL);
		CHECK_OK(rdma_post_recv(id, NULL, buf, sizeof buf, mr));
		errno = 0;
		int r = rdma_connect(id, NULL);
		if (r != 0) {
			CHECK_EQ(errno, ECONNREFUSED);
			CHECK(now_s() < end);
			CHECK_OK(rdma_dereg_mr(mr));
			rdma_destroy_ep(id);
			usleep(10000);
			continue;
		}
		memcpy(buf, "sync-request!!!", 16);
		struct ibv_wc wc;
		CHECK_OK(rdma_post_send(id, NULL, buf, sizeof buf, mr, 0));
		CHECK_EQ(rdma_get_send_comp(id, &wc), 1);
		CHECK_EQ(wc.status, IBV_WC_SUCCESS);
		/* The receive posted before the connect now holds the reply. */
		CHECK_EQ(rdma_get_recv_comp(id, &wc), 1);
		CHECK_EQ(wc.status, IBV_WC_SUCCESS);
		CHECK_MEM(buf, "sync-reply!!!!!", 16);
		CHECK_OK(rdma_disconnect(id));
		CHECK_OK(rdma_dereg_mr(mr));
		rdma_destroy_ep(id);
		break;
	}
	rdma_freeaddrinfo(res);
	CHECK_OK(pthread_join(t, NULL));
}

/* A channel's descriptor reads as ready exactly while an event is queued on it, and an
 * event the fabric brings wakes a program asleep in poll(2) on it (the library's progress
 * thread drives the NICs' connection managers meanwhile). */
static volatile sig_atomic_t signals;
static void on_signal(int sig)
{
	(void)sig;
	signals++;
}

/* SIGUSR1 to the thread `arg` points to, 50 ms from now. */
static void *signal_later(void *arg)
{
	struct timespec ts = {.tv_nsec = 50 * 1000 * 1000};
	nanosleep(&ts, NULL);
	pthread_kill(*(pthread_t *)arg, SIGUSR1);
	return NULL;
}

static void channel_descriptor(void)
{
	struct rdma_event_channel *ch = rdma_create_event_channel();
	CHECK(ch != NULL);
	struct pollfd p = {.fd = ch->fd, .events = POLLIN};
	CHECK_EQ(poll(&p, 1, 50), 0);
	struct rdma_cm_id *id;
	CHECK_OK(rdma_create_id(ch, &id, NULL, RDMA_PS_TCP));
	struct sockaddr_in src = sin_of("10.0.0.2", 0), dst = sin_of("10.0.0.1", 7999);
	CHECK_OK(rdma_resolve_addr(id, (struct sockaddr *)&src, (struct sockaddr *)&dst, 1000));
	/* ADDR_RESOLVED is queued by the call: readable, then drained by taking it. */
	CHECK_EQ(poll(&p, 1, 1000), 1);
	CHECK(p.revents & POLLIN);
	CHECK_OK(rdma_ack_cm_event(expect_event(ch, RDMA_CM_EVENT_ADDR_RESOLVED)));
	CHECK_EQ(poll(&p, 1, 0), 0);
	CHECK_OK(rdma_resolve_route(id, 1000));
	CHECK_OK(rdma_ack_cm_event(expect_event(ch, RDMA_CM_EVENT_ROUTE_RESOLVED)));
	/* A listener on another port of rb0 (its connection manager answers from then on). */
	struct rdma_cm_id *other;
	CHECK_OK(rdma_create_id(ch, &other, NULL, RDMA_PS_TCP));
	struct sockaddr_in on0 = sin_of("10.0.0.1", 7998);
	CHECK_OK(rdma_bind_addr(other, (struct sockaddr *)&on0));
	CHECK_OK(rdma_listen(other, 1));
	/* A request to a port nobody listens on (the QP named only: none is needed to be
	 * refused); its rejection comes back through the fabric while this thread sleeps. */
	struct rdma_conn_param cp = {.qp_num = 77, .retry_count = 7, .rnr_retry_count = 7};
	CHECK_OK(rdma_connect(id, &cp));
	CHECK_EQ(poll(&p, 1, 5000), 1);
	CHECK_OK(rdma_ack_cm_event(expect_event(ch, RDMA_CM_EVENT_REJECTED)));
	CHECK_EQ(poll(&p, 1, 0), 0);
	/* Nothing queued: a blocking rdma_get_cm_event that a signal handler without
	 * SA_RESTART interrupts fails with EINTR, as its read(2) of the descriptor does. */
	struct sigaction sa = {.sa_handler = on_signal};
	sigemptyset(&sa.sa_mask);
	CHECK_EQ(sigaction(SIGUSR1, &sa, NULL), 0);
	pthread_t t;
	pthread_t self = pthread_self();
	CHECK_EQ(pthread_create(&t, NULL, signal_later, &self), 0);
	struct rdma_cm_event *none;
	errno = 0;
	CHECK_EQ(rdma_get_cm_event(ch, &none), -1);
	CHECK_EQ(errno, EINTR);
	CHECK_EQ(pthread_join(t, NULL), 0);
	CHECK_EQ(signals, 1);
	signal(SIGUSR1, SIG_DFL);
	CHECK_OK(rdma_destroy_id(id));
	CHECK_OK(rdma_destroy_id(other));
	rdma_destroy_event_channel(ch);
}

int main(void)
{
	struct rdma_event_channel *sch = rdma_create_event_channel();
	struct rdma_event_channel *cch = rdma_create_event_channel();
	CHECK(sch && cch && sch->fd >= 0 && cch->fd >= 0);
	struct rdma_cm_event *e;

	/* ---- refusals ---- */
	struct rdma_cm_id *x;
	errno = 0;
	CHECK_EQ(rdma_create_id(sch, &x, NULL, RDMA_PS_IPOIB), -1);
	CHECK_EQ(errno, EPROTONOSUPPORT);
	CHECK_OK(rdma_create_id(sch, &x, NULL, RDMA_PS_TCP));
	struct sockaddr_in other = sin_of("10.9.9.9", 7471);
	errno = 0;
	CHECK_EQ(rdma_bind_addr(x, (struct sockaddr *)&other), -1);
	CHECK_EQ(errno, EADDRNOTAVAIL);
	errno = 0;
	CHECK_EQ(rdma_resolve_route(x, 100), -1);
	CHECK_EQ(errno, EINVAL);
	errno = 0;
	CHECK_EQ(rdma_connect(x, NULL), -1);
	CHECK_EQ(errno, EINVAL);
	errno = 0;
	CHECK_EQ(rdma_accept(x, NULL), -1);
	CHECK_EQ(errno, EINVAL);
	CHECK_OK(rdma_destroy_id(x));
	errno = 0;
	CHECK_EQ(rdma_destroy_id(x), -1); /* destroyed once */
	CHECK_EQ(errno, EINVAL);
	/* Nothing queued on a non-blocking channel: EAGAIN. */
	int fl = fcntl(cch->fd, F_GETFL);
	CHECK_OK(fcntl(cch->fd, F_SETFL, fl | O_NONBLOCK));
	errno = 0;
	CHECK_EQ(rdma_get_cm_event(cch, &e), -1);
	CHECK_EQ(errno, EAGAIN);
	CHECK_OK(fcntl(cch->fd, F_SETFL, fl));
	CHECK(strcmp(rdma_event_str(RDMA_CM_EVENT_ESTABLISHED), "RDMA_CM_EVENT_ESTABLISHED") == 0);
	channel_descriptor();

	/* ---- a listener on rb0 ---- */
	struct rdma_cm_id *lid;
	CHECK_OK(rdma_create_id(sch, &lid, (void *)0x5e7, RDMA_PS_TCP));
	struct sockaddr_in laddr = sin_of("10.0.0.1", 7471);
	CHECK_OK(rdma_bind_addr(lid, (struct sockaddr *)&laddr));
	CHECK(lid->verbs != NULL);
	CHECK(strcmp(ibv_get_device_name(lid->verbs->device), "rb0") == 0);
	CHECK_EQ(ntohs(rdma_get_src_port(lid)), 7471);
	CHECK_OK(rdma_listen(lid, 4));
	struct rdma_cm_id *dup;
	CHECK_OK(rdma_create_id(sch, &dup, NULL, RDMA_PS_TCP));
	errno = 0;
	CHECK_EQ(rdma_bind_addr(dup, (struct sockaddr *)&laddr), -1);
	CHECK_EQ(errno, EADDRINUSE);
	CHECK_OK(rdma_destroy_id(dup));

	/* ---- a connection from rb1, step by step ---- */
	struct rdma_cm_id *cli;
	CHECK_OK(rdma_create_id(cch, &cli, (void *)0xc11, RDMA_PS_TCP));
	struct sockaddr_in src = sin_of("10.0.0.2", 0), dst = sin_of("10.0.0.1", 7471);
	CHECK_OK(rdma_resolve_addr(cli, (struct sockaddr *)&src, (struct sockaddr *)&dst, 1000));
	e = expect_event(cch, RDMA_CM_EVENT_ADDR_RESOLVED);
	CHECK(e->id == cli && e->status == 0 && e->id->context == (void *)0xc11);
	CHECK_OK(rdma_ack_cm_event(e));
	errno = 0;
	CHECK_EQ(rdma_ack_cm_event(e), -1); /* acknowledged once */
	CHECK_EQ(errno, EINVAL);
	CHECK(strcmp(ibv_get_device_name(cli->verbs->device), "rb1") == 0);
	CHECK_EQ(ip_of(rdma_get_local_addr(cli)), 0x0a000002);
	CHECK_EQ(ip_of(rdma_get_peer_addr(cli)), 0x0a000001);
	CHECK_EQ(ntohs(rdma_get_dst_port(cli)), 7471);
	uint16_t cport = ntohs(rdma_get_src_port(cli));
	CHECK(cport != 0);
	errno = 0;
	CHECK_EQ(rdma_connect(cli, NULL), -1); /* the route first */
	CHECK_EQ(errno, EINVAL);
	CHECK_OK(rdma_resolve_route(cli, 1000));
	CHECK_OK(rdma_ack_cm_event(expect_event(cch, RDMA_CM_EVENT_ROUTE_RESOLVED)));

	/* The QP: the id's device, the library's PD and CQs of its own; in INIT. */
	struct ibv_qp_init_attr a = rc_attr();
	CHECK_OK(rdma_create_qp(cli, NULL, &a));
	CHECK(cli->qp != NULL && cli->pd != NULL && cli->send_cq != NULL && cli->recv_cq != NULL);
	CHECK(cli->send_cq_channel != NULL && a.send_cq == cli->send_cq);
	CHECK(cli->qp->context == cli->verbs);
	CHECK_EQ(qp_state(cli->qp), IBV_QPS_INIT);
	errno = 0;
	CHECK_EQ(rdma_create_qp(cli, NULL, &a), -1); /* one QP per id */
	CHECK_EQ(errno, EINVAL);
	uint8_t *cbuf = calloc(1, 4096);
	struct ibv_mr *cmr = ibv_reg_mr(cli->pd, cbuf, 4096, ACC_ALL);
	CHECK(cmr != NULL);
	/* A receive posted in INIT waits for the connection. */
	CHECK_OK(rdma_post_recv(cli, (void *)1, cbuf, 64, cmr));

	struct rdma_conn_param p;
	memset(&p, 0, sizeof p);
	char big[64];
	memset(big, 'x', sizeof big);
	p.private_data = big;
	p.private_data_len = 57; /* a request carries 56 */
	errno = 0;
	CHECK_EQ(rdma_connect(cli, &p), -1);
	CHECK_EQ(errno, EINVAL);
	char req[16];
	snprintf(req, sizeof req, "rkey %08x", cmr->rkey);
	p.private_data = req;
	p.private_data_len = sizeof req;
	p.initiator_depth = 2;
	p.responder_resources = 3;
	p.retry_count = 7;
	p.rnr_retry_count = 7;
	CHECK_OK(rdma_connect(cli, &p));

	e = expect_event(sch, RDMA_CM_EVENT_CONNECT_REQUEST);
	CHECK(e->listen_id == lid && e->id != lid && e->id != NULL);
	struct rdma_cm_id *srv = e->id;
	CHECK(srv->context == (void *)0x5e7);
	CHECK_EQ(e->param.conn.private_data_len, 56);
	CHECK_MEM(e->param.conn.private_data, req, sizeof req);
	for (int i = sizeof req; i < 56; i++)
		CHECK_EQ(((const uint8_t *)e->param.conn.private_data)[i], 0);
	/* The requester's initiator depth is this side's responder resources. */
	CHECK_EQ(e->param.conn.responder_resources, 2);
	CHECK_EQ(e->param.conn.initiator_depth, 3);
	CHECK(strcmp(ibv_get_device_name(srv->verbs->device), "rb0") == 0);
	CHECK_EQ(ip_of(rdma_get_peer_addr(srv)), 0x0a000002);
	CHECK_EQ(ntohs(rdma_get_dst_port(srv)), cport);
	CHECK_EQ(ntohs(rdma_get_src_port(srv)), 7471);
	CHECK_OK(rdma_ack_cm_event(e));
	a = rc_attr();
	CHECK_OK(rdma_create_qp(srv, NULL, &a));
	uint8_t *sbuf = calloc(1, 4096);
	struct ibv_mr *smr = ibv_reg_mr(srv->pd, sbuf, 4096, ACC_ALL);
	CHECK(smr != NULL);
	CHECK_OK(rdma_post_recv(srv, (void *)2, sbuf, 64, smr));
	memset(&p, 0, sizeof p);
	p.private_data = big;
	p.private_data_len = 197; /* an accept carries 196 */
	errno = 0;
	CHECK_EQ(rdma_accept(srv, &p), -1);
	CHECK_EQ(errno, EINVAL);
	p.private_data = "accepted";
	p.private_data_len = 9;
	p.responder_resources = 2;
	p.initiator_depth = 2;
	CHECK_OK(rdma_accept(srv, &p));
	CHECK_EQ(qp_state(srv->qp), IBV_QPS_RTS);

	e = expect_event(cch, RDMA_CM_EVENT_ESTABLISHED);
	CHECK(e->id == cli);
	CHECK_EQ(e->param.conn.private_data_len, 196);
	CHECK_MEM(e->param.conn.private_data, "accepted", 9);
	CHECK_OK(rdma_ack_cm_event(e));
	e = expect_event(sch, RDMA_CM_EVENT_ESTABLISHED);
	CHECK(e->id == srv);
	CHECK_OK(rdma_ack_cm_event(e));
	CHECK_EQ(qp_state(cli->qp), IBV_QPS_RTS);

	/* Data: a SEND each way, then an RDMA WRITE with the key the request carried. */
	struct ibv_wc wc;
	memcpy(cbuf + 1024, "from the client", 16);
	CHECK_OK(rdma_post_send(cli, (void *)3, cbuf + 1024, 16, cmr, IBV_SEND_SIGNALED));
	EXPECT_WC(cli->send_cq, &wc, IBV_WC_SUCCESS, IBV_WC_SEND);
	EXPECT_WC(srv->recv_cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
	CHECK_EQ(wc.wr_id, 2);
	CHECK_MEM(sbuf, "from the client", 16);
	uint32_t rkey = 0;
	CHECK_EQ(sscanf(req, "rkey %x", &rkey), 1);
	memcpy(sbuf + 512, "written by the server", 22);
	CHECK_OK(rdma_post_write(srv, (void *)4, sbuf + 512, 22, smr, IBV_SEND_SIGNALED,
				 (uint64_t)(uintptr_t)(cbuf + 2048), rkey));
	EXPECT_WC(srv->send_cq, &wc, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE);
	CHECK_MEM(cbuf + 2048, "written by the server", 22);
	CHECK_OK(rdma_post_send(srv, (void *)5, sbuf + 512, 22, smr, IBV_SEND_SIGNALED));
	EXPECT_WC(srv->send_cq, &wc, IBV_WC_SUCCESS, IBV_WC_SEND);
	EXPECT_WC(cli->recv_cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
	CHECK_EQ(wc.wr_id, 1);

	/* Disconnect: QPs in ERR, a receive still posted flushes. */
	CHECK_OK(rdma_post_recv(srv, (void *)6, sbuf, 64, smr));
	struct conn c = {cli, srv};
	CHECK_OK(rdma_disconnect(cli));
	CHECK_EQ(qp_state(cli->qp), IBV_QPS_ERR);
	CHECK_OK(rdma_ack_cm_event(expect_event(sch, RDMA_CM_EVENT_DISCONNECTED)));
	CHECK_OK(rdma_ack_cm_event(expect_event(cch, RDMA_CM_EVENT_DISCONNECTED)));
	CHECK_EQ(qp_state(srv->qp), IBV_QPS_ERR);
	EXPECT_WC(srv->recv_cq, &wc, IBV_WC_WR_FLUSH_ERR, -1);
	CHECK_EQ(wc.wr_id, 6);
	CHECK_OK(ibv_dereg_mr(cmr));
	CHECK_OK(ibv_dereg_mr(smr));
	free(cbuf);
	free(sbuf);
	rdma_destroy_qp(c.cli);
	rdma_destroy_qp(c.srv);
	CHECK_OK(rdma_destroy_id(c.cli));
	CHECK_OK(rdma_destroy_id(c.srv));

	/* ---- a reject, with private data ---- */
	struct rdma_cm_id *r = resolved(cch, RDMA_PS_TCP, "10.0.0.2", "10.0.0.1", 7471, IBV_QPT_RC);
	CHECK_OK(rdma_connect(r, NULL));
	e = expect_event(sch, RDMA_CM_EVENT_CONNECT_REQUEST);
	struct rdma_cm_id *rs = e->id;
	CHECK_OK(rdma_ack_cm_event(e));
	errno = 0;
	CHECK_EQ(rdma_reject(rs, big, 149), -1); /* a reject carries 148 */
	CHECK_EQ(errno, EINVAL);
	CHECK_OK(rdma_reject(rs, "go away", 8));
	e = expect_event(cch, RDMA_CM_EVENT_REJECTED);
	CHECK(e->id == r);
	CHECK_EQ(e->status, 28); /* IB_CM_REJ_CONSUMER_DEFINED */
	CHECK_EQ(e->param.conn.private_data_len, 148);
	CHECK_MEM(e->param.conn.private_data, "go away", 8);
	CHECK_OK(rdma_ack_cm_event(e));
	CHECK_OK(rdma_destroy_id(rs));
	rdma_destroy_qp(r);
	CHECK_OK(rdma_destroy_id(r));

	/* ---- a port nobody listens on: rejected, invalid service id ---- */
	r = resolved(cch, RDMA_PS_TCP, "0.0.0.0", "10.0.0.1", 7999, IBV_QPT_RC);
	CHECK_OK(rdma_connect(r, NULL));
	e = expect_event(cch, RDMA_CM_EVENT_REJECTED);
	CHECK_EQ(e->status, 8); /* IB_CM_REJ_INVALID_SERVICE_ID */
	CHECK_OK(rdma_ack_cm_event(e));
	rdma_destroy_qp(r);
	CHECK_OK(rdma_destroy_id(r));

	/* ---- a listener destroyed with a request it has not reported: refused ---- */
	struct rdma_cm_id *l2;
	CHECK_OK(rdma_create_id(sch, &l2, NULL, RDMA_PS_TCP));
	struct sockaddr_in l2addr = sin_of("10.0.0.1", 7475);
	CHECK_OK(rdma_bind_addr(l2, (struct sockaddr *)&l2addr));
	CHECK_OK(rdma_listen(l2, 1));
	r = resolved(cch, RDMA_PS_TCP, "10.0.0.2", "10.0.0.1", 7475, IBV_QPT_RC);
	CHECK_OK(rdma_connect(r, NULL));
	/* The request reaches the listener's NIC while the client's channel is polled. */
	fl = fcntl(cch->fd, F_GETFL);
	CHECK_OK(fcntl(cch->fd, F_SETFL, fl | O_NONBLOCK));
	for (int i = 0; i < 200; i++) {
		errno = 0;
		if (rdma_get_cm_event(cch, &e) == 0)
			FAIL("event %s (status %d) on the client", rdma_event_str(e->event), e->status);
		CHECK_EQ(errno, EAGAIN);
	}
	CHECK_OK(fcntl(cch->fd, F_SETFL, fl));
	CHECK_OK(rdma_destroy_id(l2));
	e = expect_event(cch, RDMA_CM_EVENT_REJECTED);
	CHECK_EQ(e->status, 28);
	CHECK_OK(rdma_ack_cm_event(e));
	rdma_destroy_qp(r);
	CHECK_OK(rdma_destroy_id(r));

	/* ---- a listener's backlog: requests it has not handed out beyond it are refused ---- */
	{
		struct rdma_cm_id *l3;
		CHECK_OK(rdma_create_id(sch, &l3, NULL, RDMA_PS_TCP));
		struct sockaddr_in l3a = sin_of("10.0.0.1", 7477);
		CHECK_OK(rdma_bind_addr(l3, (struct sockaddr *)&l3a));
		CHECK_OK(rdma_listen(l3, 1));
		struct rdma_cm_id *first = resolved(cch, RDMA_PS_TCP, "10.0.0.2", "10.0.0.1", 7477,
						    IBV_QPT_RC);
		struct rdma_cm_id *second = resolved(cch, RDMA_PS_TCP, "10.0.0.2", "10.0.0.1", 7477,
						     IBV_QPT_RC);
		CHECK_OK(rdma_connect(first, NULL));
		CHECK_OK(rdma_connect(second, NULL));
		e = expect_event(cch, RDMA_CM_EVENT_REJECTED);
		CHECK(e->id == second);
		CHECK_EQ(e->status, 28);
		CHECK_OK(rdma_ack_cm_event(e));
		e = expect_event(sch, RDMA_CM_EVENT_CONNECT_REQUEST);
		CHECK(e->listen_id == l3);
		struct rdma_cm_id *req3 = e->id;
		CHECK_OK(rdma_ack_cm_event(e));
		CHECK_OK(rdma_reject(req3, NULL, 0));
		CHECK_OK(rdma_ack_cm_event(expect_event(cch, RDMA_CM_EVENT_REJECTED)));
		CHECK_OK(rdma_destroy_id(req3));
		rdma_destroy_qp(first);
		rdma_destroy_qp(second);
		CHECK_OK(rdma_destroy_id(first));
		CHECK_OK(rdma_destroy_id(second));
		CHECK_OK(rdma_destroy_id(l3));
	}

	/* ---- an id's SRQ (rdma_create_srq): its QP takes receives from it ---- */
	CHECK_OK(rdma_create_id(cch, &r, NULL, RDMA_PS_TCP));
	CHECK_OK(rdma_resolve_addr(r, NULL, (struct sockaddr *)&dst, 1000));
	CHECK_OK(rdma_ack_cm_event(expect_event(cch, RDMA_CM_EVENT_ADDR_RESOLVED)));
	struct ibv_srq_init_attr sa = {.attr = {.max_wr = 16, .max_sge = 1}};
	CHECK_OK(rdma_create_srq(r, NULL, &sa));
	CHECK(r->srq != NULL && r->srq->pd == r->pd);
	errno = 0;
	CHECK_EQ(rdma_create_srq(r, NULL, &sa), -1); /* one SRQ per id */
	CHECK_EQ(errno, EINVAL);
	struct ibv_srq_init_attr_ex sx = {.attr = {.max_wr = 16, .max_sge = 1}};
	errno = 0;
	CHECK_EQ(rdma_create_srq_ex(r, &sx), -1); /* librdmacm asks for the type */
	CHECK_EQ(errno, EINVAL);
	a = rc_attr();
	CHECK_OK(rdma_create_qp(r, NULL, &a));
	CHECK(r->qp->srq == r->srq);
	struct ibv_ece ece = {0};
	errno = 0;
	CHECK_EQ(rdma_set_local_ece(r, &ece), -1);
	CHECK_EQ(errno, EOPNOTSUPP);
	rdma_destroy_qp(r);
	rdma_destroy_srq(r);
	CHECK(r->srq == NULL);
	CHECK_OK(rdma_destroy_id(r));

	/* ---- XRC: an initiator QP connected to a target QP, a send to its XRC SRQ ---- */
	{
		struct rdma_cm_id *lx;
		CHECK_OK(rdma_create_id(sch, &lx, NULL, RDMA_PS_TCP));
		struct sockaddr_in lxa = sin_of("10.0.0.1", 7476);
		CHECK_OK(rdma_bind_addr(lx, (struct sockaddr *)&lxa));
		CHECK_OK(rdma_listen(lx, 1));
		struct rdma_cm_id *ini;
		CHECK_OK(rdma_create_id(cch, &ini, NULL, RDMA_PS_TCP));
		CHECK_OK(rdma_resolve_addr(ini, NULL, (struct sockaddr *)&lxa, 1000));
		CHECK_OK(rdma_ack_cm_event(expect_event(cch, RDMA_CM_EVENT_ADDR_RESOLVED)));
		CHECK_OK(rdma_resolve_route(ini, 1000));
		CHECK_OK(rdma_ack_cm_event(expect_event(cch, RDMA_CM_EVENT_ROUTE_RESOLVED)));
		struct ibv_qp_init_attr xa = {.qp_type = IBV_QPT_XRC_SEND,
					      .cap = {.max_send_wr = 4, .max_send_sge = 1}};
		CHECK_OK(rdma_create_qp(ini, NULL, &xa));
		CHECK(ini->qp != NULL && ini->send_cq != NULL);
		CHECK_OK(rdma_connect(ini, NULL));
		e = expect_event(sch, RDMA_CM_EVENT_CONNECT_REQUEST);
		struct rdma_cm_id *tgt = e->id;
		CHECK_OK(rdma_ack_cm_event(e));
		struct ibv_qp_init_attr ta = {.qp_type = IBV_QPT_XRC_RECV};
		CHECK_OK(rdma_create_qp(tgt, NULL, &ta));
		CHECK(tgt->qp != NULL && tgt->qp->qp_type == IBV_QPT_XRC_RECV);
		struct ibv_srq_init_attr xs = {.attr = {.max_wr = 4, .max_sge = 1}};
		CHECK_OK(rdma_create_srq(tgt, NULL, &xs));
		CHECK(tgt->srq != NULL && tgt->recv_cq != NULL);
		uint32_t srqn = 0;
		CHECK_OK(ibv_get_srq_num(tgt->srq, &srqn));
		uint8_t *xb = calloc(1, 4096);
		struct ibv_mr *xmr = ibv_reg_mr(tgt->pd, xb, 4096, IBV_ACCESS_LOCAL_WRITE);
		CHECK(xmr != NULL);
		CHECK_OK(rdma_post_recv(tgt, (void *)9, xb, 64, xmr));
		uint32_t be = htonl(srqn);
		struct rdma_conn_param xp = {.private_data = &be, .private_data_len = 4};
		CHECK_OK(rdma_accept(tgt, &xp));
		e = expect_event(cch, RDMA_CM_EVENT_ESTABLISHED);
		uint32_t got = ntohl(*(const uint32_t *)e->param.conn.private_data);
		CHECK_EQ(got, srqn);
		CHECK_OK(rdma_ack_cm_event(e));
		CHECK_OK(rdma_ack_cm_event(expect_event(sch, RDMA_CM_EVENT_ESTABLISHED)));
		char msg[] = "to an XRC SRQ";
		struct ibv_sge sg = {.addr = (uintptr_t)msg, .length = sizeof msg};
		struct ibv_send_wr sw = {.wr_id = 10, .sg_list = &sg, .num_sge = 1,
					 .opcode = IBV_WR_SEND,
					 .send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE};
		sw.qp_type.xrc.remote_srqn = got;
		struct ibv_send_wr *bad = NULL;
		CHECK_RET(ibv_post_send(ini->qp, &sw, &bad), 0);
		struct ibv_wc wc;
		EXPECT_WC(ini->send_cq, &wc, IBV_WC_SUCCESS, IBV_WC_SEND);
		EXPECT_WC(tgt->recv_cq, &wc, IBV_WC_SUCCESS, IBV_WC_RECV);
		CHECK_EQ(wc.wr_id, 9);
		CHECK_MEM(xb, msg, sizeof msg);
		struct conn xc = {ini, tgt};
		CHECK_OK(ibv_dereg_mr(xmr));
		free(xb);
		rdma_destroy_srq(tgt);
		close_pair(cch, sch, &xc);
		CHECK_OK(rdma_destroy_id(lx));
	}

	/* ---- ids without QPs: the QP numbers in the parameters, CONNECT_RESPONSE, then
	 * rdma_establish (the programs move their own QPs, as UCX's connection manager does
	 * with placeholder QPs) ---- */
	{
		struct rdma_cm_id *act;
		CHECK_OK(rdma_create_id(cch, &act, NULL, RDMA_PS_TCP));
		CHECK_OK(rdma_resolve_addr(act, NULL, (struct sockaddr *)&dst, 1000));
		CHECK_OK(rdma_ack_cm_event(expect_event(cch, RDMA_CM_EVENT_ADDR_RESOLVED)));
		CHECK_OK(rdma_resolve_route(act, 1000));
		CHECK_OK(rdma_ack_cm_event(expect_event(cch, RDMA_CM_EVENT_ROUTE_RESOLVED)));
		errno = 0;
		CHECK_EQ(rdma_establish(act), -1); /* nothing to establish yet */
		CHECK_EQ(errno, EINVAL);
		struct rdma_conn_param np = {.qp_num = 0x1234, .private_data = "own qp",
					     .private_data_len = 7};
		CHECK_OK(rdma_connect(act, &np));
		e = expect_event(sch, RDMA_CM_EVENT_CONNECT_REQUEST);
		struct rdma_cm_id *pas = e->id;
		CHECK_OK(rdma_ack_cm_event(e));
		errno = 0;
		CHECK_EQ(rdma_accept(pas, NULL), -1); /* no QP and no QP number */
		CHECK_EQ(errno, EINVAL);
		struct rdma_conn_param ap = {.qp_num = 0x4321};
		CHECK_OK(rdma_accept(pas, &ap));
		e = expect_event(cch, RDMA_CM_EVENT_CONNECT_RESPONSE);
		CHECK(e->id == act);
		CHECK_OK(rdma_ack_cm_event(e));
		CHECK_OK(rdma_establish(act));
		CHECK_OK(rdma_ack_cm_event(expect_event(sch, RDMA_CM_EVENT_ESTABLISHED)));
		/* rdma_init_qp_attr: what each side's own QP moves with. */
		struct ibv_qp_attr qa;
		int qm = 0;
		memset(&qa, 0, sizeof qa);
		qa.qp_state = IBV_QPS_RTR;
		CHECK_OK(rdma_init_qp_attr(act, &qa, &qm));
		CHECK_EQ(qa.dest_qp_num, 0x4321); /* the accept's QP */
		uint32_t act_rq = qa.rq_psn;
		CHECK(qm & IBV_QP_AV && qm & IBV_QP_DEST_QPN && qm & IBV_QP_RQ_PSN);
		CHECK_EQ(qa.ah_attr.grh.dgid.raw[15], 1); /* 10.0.0.1 */
		memset(&qa, 0, sizeof qa);
		qa.qp_state = IBV_QPS_RTR;
		CHECK_OK(rdma_init_qp_attr(pas, &qa, &qm));
		CHECK_EQ(qa.dest_qp_num, 0x1234); /* the request's QP */
		uint32_t pas_rq = qa.rq_psn;
		memset(&qa, 0, sizeof qa);
		qa.qp_state = IBV_QPS_RTS;
		CHECK_OK(rdma_init_qp_attr(act, &qa, &qm));
		CHECK(qm & IBV_QP_SQ_PSN);
		CHECK_EQ(qa.sq_psn, pas_rq); /* what the passive side expects first */
		memset(&qa, 0, sizeof qa);
		qa.qp_state = IBV_QPS_RTS;
		CHECK_OK(rdma_init_qp_attr(pas, &qa, &qm));
		CHECK_EQ(qa.sq_psn, act_rq);
		memset(&qa, 0, sizeof qa);
		qa.qp_state = IBV_QPS_INIT;
		CHECK_OK(rdma_init_qp_attr(pas, &qa, &qm));
		CHECK_EQ(qm, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
		qa.qp_state = IBV_QPS_SQD;
		errno = 0;
		CHECK_EQ(rdma_init_qp_attr(pas, &qa, &qm), -1);
		CHECK_EQ(errno, EINVAL);
		CHECK_OK(rdma_disconnect(act));
		CHECK_OK(rdma_ack_cm_event(expect_event(sch, RDMA_CM_EVENT_DISCONNECTED)));
		CHECK_OK(rdma_ack_cm_event(expect_event(cch, RDMA_CM_EVENT_DISCONNECTED)));
		CHECK_OK(rdma_destroy_id(act));
		CHECK_OK(rdma_destroy_id(pas));
	}

	/* ---- an address off the fabric ---- */
	CHECK_OK(rdma_create_id(cch, &r, NULL, RDMA_PS_TCP));
	struct sockaddr_in off = sin_of("192.168.1.1", 7471);
	CHECK_OK(rdma_resolve_addr(r, NULL, (struct sockaddr *)&off, 1000));
	e = expect_event(cch, RDMA_CM_EVENT_ADDR_ERROR);
	CHECK(e->status < 0);
	CHECK_OK(rdma_ack_cm_event(e));
	CHECK_OK(rdma_destroy_id(r));

	/* ---- within one NIC (rb0 to its own address), then a second connection from rb1:
	 * one listener takes several ---- */
	struct conn loop = connect_pair(cch, sch, lid, "0.0.0.0", "10.0.0.1", 7471);
	CHECK(strcmp(ibv_get_device_name(loop.cli->verbs->device), "rb0") == 0);
	struct conn two = connect_pair(cch, sch, lid, "10.0.0.2", "10.0.0.1", 7471);
	close_pair(cch, sch, &loop);
	close_pair(cch, sch, &two);

	/* ---- an id moved to another channel takes its events along ---- */
	CHECK_OK(rdma_create_id(cch, &r, NULL, RDMA_PS_TCP));
	CHECK_OK(rdma_resolve_addr(r, NULL, (struct sockaddr *)&dst, 1000));
	struct rdma_event_channel *moved = rdma_create_event_channel();
	CHECK(moved != NULL);
	CHECK_OK(rdma_migrate_id(r, moved));
	CHECK(r->channel == moved);
	CHECK_OK(rdma_ack_cm_event(expect_event(moved, RDMA_CM_EVENT_ADDR_RESOLVED)));
	CHECK_OK(rdma_destroy_id(r));
	rdma_destroy_event_channel(moved);

	CHECK_OK(rdma_destroy_id(lid));

	datagrams(sch, cch);
	multicast(cch);

	/* ---- the synchronous calls ---- */
	sync_client();

	rdma_destroy_event_channel(sch);
	rdma_destroy_event_channel(cch);
	printf("cma: ok\n");
	return 0;
}
