"""h2_cost.py: the h2 library's own server-side cost of one request (HEADERS in, HEADERS + DATA out), in process."""
import sys, time, h2.connection, h2.config
def run(**kw):
    cl=h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    sv=h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None, **kw))
    cl.initiate_connection(); sv.initiate_connection()
    sv.receive_data(cl.data_to_send()); cl.receive_data(sv.data_to_send()); sv.receive_data(cl.data_to_send())
    N=3000
    hdrs=[(b':method',b'GET'),(b':path',b'/'),(b':scheme',b'http'),(b':authority',b'127.0.0.1:19010'),(b'user-agent',b'h2load nghttp2/1.52.0')]
    tot=0
    for i in range(N):
        sid=cl.get_next_available_stream_id(); cl.send_headers(sid,hdrs,end_stream=True); f=cl.data_to_send()
        t=time.perf_counter()
        evs=sv.receive_data(f)
        sv.send_headers(sid,[(b':status',b'200'),(b'content-type',b'text/plain'),(b'content-length',b'3'),(b'date',b'Wed, 02 Dec 2026 02:03:55 GMT')])
        sv.send_data(sid,b'ok\n',end_stream=True)
        out=sv.data_to_send()
        tot+=time.perf_counter()-t
        cl.receive_data(out)
    return tot/N*1e6
for kw in [{}, dict(validate_outbound_headers=False, normalize_outbound_headers=False), dict(validate_outbound_headers=False, normalize_outbound_headers=False, validate_inbound_headers=False, normalize_inbound_headers=False)]:
    print(kw, f"{run(**kw):.1f} us")
