-- Python's math.nextafter and limiter.algorithms._delta / _first_true, for the doubles of an instant (>= 0)
local TINY = 4.9406564584124654e-324
local function up(x)  -- the next double above x
  if x == 0 then return TINY end
  local _, e = math.frexp(x)  -- x = m * 2^e, 0.5 <= m < 1: its ulp is 2^(e - 53)
  return x + math.ldexp(1, e - 53)
end
local function down(x)  -- the next double below x >= 0
  if x == 0 then return -TINY end
  local m, e = math.frexp(x)
  if m == 0.5 then return x - math.ldexp(1, e - 54) end
  return x - math.ldexp(1, e - 53)
end
local function delta(x, t)  -- seconds from t until x, rounded so that t + result >= x
  local r = x - t
  if r <= 0 then return 0.0 end
  while t + r < x do r = up(r) end
  return r
end
