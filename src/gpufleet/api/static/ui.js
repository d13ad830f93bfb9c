// The dashboard's one script of its own (the Content-Security-Policy allows scripts from
// /ui/static only, no inline ones): a log tail marked data-follow="bottom" stays scrolled to
// its end after each htmx refresh.
document.addEventListener("htmx:afterSwap", function (event) {
  var el = event.detail && event.detail.target;
  if (el && el.dataset && el.dataset.follow === "bottom") {
    el.scrollTop = el.scrollHeight;
  }
});
