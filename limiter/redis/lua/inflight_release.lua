redis.call('ZREM', KEYS[1], ARGV[2])
return 1
