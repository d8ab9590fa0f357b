// bench/first_answer.py's client (issue 31): like wrk -c N, but it keeps each connection's first request (connect included)
// apart from the steady ones, so a slow accept shows as itself; gcc -O2 -o /tmp/closed_loop bench/closed_loop.c
#define _GNU_SOURCE
// closed-loop HTTP/1.1 keep-alive client: per-request latency, first requests (connect included) apart
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <errno.h>
#include <fcntl.h>
#include <time.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <arpa/inet.h>
typedef struct { int fd; int first; double start; char buf[4096]; int len; int busy; long n; } conn;
static double now(void){ struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9; }
static int cmpd(const void*a,const void*b){ double x=*(double*)a,y=*(double*)b; return x<y?-1:x>y; }
static double *lat,*flat; static long nlat,nflat,cap;
static char req[512]; static int reqlen; static struct sockaddr_in sa;
static void opn(conn*c,int ep){ c->fd=socket(AF_INET,SOCK_STREAM|SOCK_NONBLOCK,0); int one=1;
  setsockopt(c->fd,IPPROTO_TCP,TCP_NODELAY,&one,4); c->start=now(); c->first=1; c->len=0; c->busy=1;
  connect(c->fd,(struct sockaddr*)&sa,sizeof sa); struct epoll_event e={.events=EPOLLOUT|EPOLLIN,.data.ptr=c};
  epoll_ctl(ep,EPOLL_CTL_ADD,c->fd,&e); c->n=-1; }
int main(int argc,char**argv){
  if(argc<5){fprintf(stderr,"cl PORT CONNS SECONDS WARMUP_S\n");return 2;}
  int port=atoi(argv[1]),nc=atoi(argv[2]); double dur=atof(argv[3]), warm=atof(argv[4]);
  reqlen=snprintf(req,sizeof req,"GET / HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nX-Api-Key: bench-unlimited\r\n\r\n",port);
  sa.sin_family=AF_INET; sa.sin_port=htons(port); inet_pton(AF_INET,"127.0.0.1",&sa.sin_addr);
  cap=50000000; lat=malloc(cap*8); flat=malloc(nc*8*4);
  int ep=epoll_create1(0); conn*cs=calloc(nc,sizeof(conn));
  double t0=now(); for(int i=0;i<nc;i++) opn(&cs[i],ep);
  double tm=t0+warm, te=tm+dur; struct epoll_event ev[256]; long done=0; double lastfirst=0;
  while(1){ double t=now(); if(t>=te) break;
    int k=epoll_wait(ep,ev,256,50);
    for(int j=0;j<k;j++){ conn*c=ev[j].data.ptr;
      if(c->n==-1){ // connected: send first request, keep start = connect time
        c->n=0; struct epoll_event e={.events=EPOLLIN,.data.ptr=c}; epoll_ctl(ep,EPOLL_CTL_MOD,c->fd,&e);
        if(write(c->fd,req,reqlen)!=reqlen){perror("write");return 1;} continue; }
      int r=read(c->fd,c->buf+c->len,sizeof c->buf-c->len-1);
      if(r<=0){ if(r<0&&errno==EAGAIN) continue; fprintf(stderr,"conn closed (n=%ld)\n",c->n); close(c->fd); opn(c,ep); continue; }
      c->len+=r; c->buf[c->len]=0; char*h=strstr(c->buf,"\r\n\r\n"); if(!h) continue;
      char*cl=strcasestr(c->buf,"content-length:"); int bl=cl?atoi(cl+15):0;
      if(c->len < (h+4-c->buf)+bl) continue;
      double t2=now(), l=t2-c->start;
      if(c->first){ flat[nflat++]=l; if(t2>lastfirst) lastfirst=t2; }
      else if(c->start>=tm){ if(nlat<cap) lat[nlat++]=l; }
      if(c->start>=tm) done++;
      c->first=0; c->len=0; c->n++; c->start=now();
      if(write(c->fd,req,reqlen)!=reqlen){perror("write");return 1;}
    } }
  double oldest=0; double t=now(); for(int i=0;i<nc;i++) if(t-cs[i].start>oldest) oldest=t-cs[i].start;
  qsort(lat,nlat,8,cmpd); qsort(flat,nflat,8,cmpd); double s=0; for(long i=0;i<nlat;i++) s+=lat[i];
  #define P(a,n,q) ((n)?(a)[(long)((q)*((n)-1))]*1e3:0)
  printf("rps %.0f steady n %ld mean %.1f p50 %.1f p90 %.1f p99 %.1f p999 %.1f max %.1f ms | first n %ld p50 %.1f max %.1f ms, all connected+answered by %.2f s | oldest in flight at end %.1f ms\n",
    done/dur,nlat,nlat?s/nlat*1e3:0,P(lat,nlat,.5),P(lat,nlat,.9),P(lat,nlat,.99),P(lat,nlat,.999),nlat?lat[nlat-1]*1e3:0,
    nflat,P(flat,nflat,.5),nflat?flat[nflat-1]*1e3:0,lastfirst?lastfirst-t0:0,oldest*1e3);
  return 0; }
