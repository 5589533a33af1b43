// personaplex-voice eval report: a playhead on each call's timeline follows its audio player, and a
// click on the timeline seeks there. Inlined into report.html; no network, no libraries.
(function () {
  "use strict";
  document.querySelectorAll(".call").forEach(function (call) {
    var svg = call.querySelector("svg.timeline");
    var audio = call.querySelector("audio");
    if (!svg || !audio) {
      return;
    }
    var head = svg.querySelector(".playhead");
    var duration = parseFloat(svg.getAttribute("data-duration")) || 0;
    var x0 = parseFloat(svg.getAttribute("data-x0")) || 0;
    var width = parseFloat(svg.getAttribute("data-width")) || 1;
    var frame = null;

    function place() {
      if (!head || duration <= 0) {
        return;
      }
      var x = x0 + Math.min(1, audio.currentTime / duration) * width;
      head.setAttribute("x1", x.toFixed(1));
      head.setAttribute("x2", x.toFixed(1));
    }

    function follow() {
      place();
      frame = audio.paused ? null : window.requestAnimationFrame(follow);
    }

    audio.addEventListener("play", function () {
      if (frame === null) {
        frame = window.requestAnimationFrame(follow);
      }
    });
    audio.addEventListener("seeked", place);
    audio.addEventListener("timeupdate", place);
    svg.addEventListener("click", function (event) {
      var box = svg.getBoundingClientRect();
      var scale = svg.viewBox.baseVal.width / box.width;
      var x = (event.clientX - box.left) * scale;
      var t = ((x - x0) / width) * duration;
      if (t >= 0 && t <= duration && isFinite(audio.duration)) {
        audio.currentTime = t;
        place();
      }
    });
  });
})();
