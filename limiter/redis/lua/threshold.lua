-- SlidingCounter._earliest and _first_true: the same float expressions walking the same floats
local function first_true(pred, lo, hi, guess)  -- the earliest float in [lo, hi] with pred, pred(hi) true
  local x = math.min(math.max(guess, lo), hi)
  local f, t
  if pred(x) then
    for _ = 1, 64 do
      if x <= lo then return lo end
      local y = down(x)
      if not pred(y) then return x end
      x = y
    end
    f, t = lo, x
    if pred(f) then return f end
  else
    for _ = 1, 64 do
      x = up(x)
      if x >= hi then return hi end
      if pred(x) then return x end
    end
    f, t = x, hi
  end
  while true do
    local m = f + (t - f) / 2.0
    if m <= f or m >= t then return t end
    if pred(m) then t = m else f = m end
  end
end
local function earliest(sk, prev, cur, extra, w, limit)  -- the first instant >= sk*W: extra + 1 in a row pass
  local start, stop = sk * w, (sk + 1) * w
  local cc = cur + extra
  if cc < limit then
    if prev == 0 then return start end
    local function pred(x) return prev * (1.0 - (x - start) / w) + cc < limit end
    if pred(start) then return start end
    return first_true(pred, start, stop, start + w * (1.0 - (limit - cc) / prev))
  end
  local function pred1(x) return cur * (1.0 - (x - stop) / w) + extra < limit end
  return first_true(pred1, stop, (sk + 2) * w, stop + w * (1.0 - (limit - extra) / cur))
end
